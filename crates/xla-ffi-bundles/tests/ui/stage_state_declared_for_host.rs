// A host bundle cannot declare a prepare-stage state: XLA:CPU runs no prepare stage and keeps
// no such state, so the const declaration does not compile (the builder's assertion).
use xla_ffi_bundles::ffi::{
    Bundle, BundleDef, Context, Execute, FfiResult, Host, NoState, Prepare, Stage,
};

struct Scratch(u32);
xla_ffi_bundles::state_type!(Scratch, "ui.Scratch");

struct Plan;

impl Bundle for Plan {
    const TARGET: &'static str = "plan";
    type Platform = Host;
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
