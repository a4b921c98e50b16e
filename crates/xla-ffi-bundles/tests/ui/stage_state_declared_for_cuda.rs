// The reference case: a CUDA bundle whose prepare stage keeps a state, declared on the builder.
// It must compile, so that the host case beside it fails for the platform alone.
use xla_ffi_bundles::ffi::{
    Bundle, BundleDef, Context, Cuda, Execute, FfiResult, NoState, Prepare, Stage,
};

struct Scratch(u32);
xla_ffi_bundles::state_type!(Scratch, "ui.Scratch");

struct Plan;

impl Bundle for Plan {
    const TARGET: &'static str = "plan";
    type Platform = Cuda;
    type State = NoState;
}

impl Prepare for Plan {
    type Attrs<'a> = ();
    fn prepare(_: &NoState, ctx: &Context<'_>, (): ()) -> FfiResult<()> {
        ctx.set_stage_state(Scratch(1)).map(|_| ())
    }
}

impl Execute for Plan {
    type Args<'a> = ();
    type Rets<'a> = ();
    type Attrs<'a> = ();
    fn execute(_: &NoState, ctx: &Context<'_>, (): (), (): (), (): ()) -> FfiResult<()> {
        let _rows = ctx.stage_state::<Scratch>(Stage::Prepare)?.0;
        Ok(())
    }
}

const PLAN: BundleDef = BundleDef::of::<Plan>()
    .prepare()
    .prepare_state::<Scratch>()
    .execute()
    .build();

fn main() {
    assert_eq!(PLAN.types().len(), 1);
}
