// A CUDA bundle that views its argument as a host slice: `as_slice` exists only for host
// buffers, so this must not compile.
use xla_ffi_bundles::ffi::{
    AnyBuffer, AnyResult, Bundle, BundleDef, Context, Cuda, Execute, FfiResult, NoState,
};

struct DeviceCopy;

impl Bundle for DeviceCopy {
    const TARGET: &'static str = "device_copy";
    type Platform = Cuda;
    type State = NoState;
}

impl Execute for DeviceCopy {
    type Args<'a> = (AnyBuffer<'a, Cuda>,);
    type Rets<'a> = (AnyResult<'a, Cuda>,);
    type Attrs<'a> = ();
    fn execute(
        _: &NoState,
        _ctx: &Context<'_>,
        (x,): (AnyBuffer<'_, Cuda>,),
        (y,): (AnyResult<'_, Cuda>,),
        (): (),
    ) -> FfiResult<()> {
        let _values: &[f32] = x.as_slice::<f32>()?;
        let _address = y.device_ptr();
        Ok(())
    }
}

const DEVICE_COPY: BundleDef = BundleDef::of::<DeviceCopy>().execute().build();

fn main() {
    assert_eq!(DEVICE_COPY.platform, "cuda");
}
