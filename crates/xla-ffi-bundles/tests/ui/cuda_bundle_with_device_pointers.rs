// The reference case: a CUDA bundle that passes device addresses on. It must compile, so that
// the two compile-fail cases beside it fail for the one line each changes.
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
        // A real bundle would enqueue a copy of x.byte_size() bytes on ctx.stream().
        let _addresses = (x.device_ptr(), y.device_ptr(), x.byte_size());
        Ok(())
    }
}

const DEVICE_COPY: BundleDef = BundleDef::of::<DeviceCopy>().execute().build();

fn main() {
    assert_eq!(DEVICE_COPY.platform, "cuda");
}
