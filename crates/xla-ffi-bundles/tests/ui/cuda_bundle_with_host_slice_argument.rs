// A CUDA bundle that asks for a typed host slice of an argument: device memory is not host
// memory, so `Buffer` is no argument type for it and this must not compile.
use xla_ffi_bundles::ffi::{
    AnyResult, Buffer, Bundle, BundleDef, Context, Cuda, Execute, FfiResult, NoState,
};

struct DeviceCopy;

impl Bundle for DeviceCopy {
    const TARGET: &'static str = "device_copy";
    type Platform = Cuda;
    type State = NoState;
}

impl Execute for DeviceCopy {
    type Args<'a> = (Buffer<'a, f32>,);
    type Rets<'a> = (AnyResult<'a, Cuda>,);
    type Attrs<'a> = ();
    fn execute(
        _: &NoState,
        _ctx: &Context<'_>,
        (x,): (Buffer<'_, f32>,),
        (y,): (AnyResult<'_, Cuda>,),
        (): (),
    ) -> FfiResult<()> {
        let _sum: f32 = x.data.iter().sum();
        let _address = y.device_ptr();
        Ok(())
    }
}

const DEVICE_COPY: BundleDef = BundleDef::of::<DeviceCopy>().execute().build();

fn main() {
    assert_eq!(DEVICE_COPY.platform, "cuda");
}
