//! Handler bundles: one Rust type per XLA target, one trait per execution stage, and one
//! declaration that turns the stages it implements into the `XLA_FFI_Handler_Bundle` XLA takes.
//!
//! ```text
//! struct Scale;
//! impl Bundle for Scale {
//!     const TARGET: &'static str = "scale";
//!     type Platform = Host;
//!     type State = ScaleState;
//! }
//! impl Instantiate for Scale { type Attrs<'a> = ScaleAttrs; fn instantiate(..) -> .. }
//! impl Execute for Scale { type Args<'a> = (Buffer<'a, f32>,); ... fn execute(..) -> .. }
//!
//! pub const SCALE: BundleDef = BundleDef::of::<Scale>().instantiate().execute().build();
//! ```
//!
//! The typed signature lives in the associated types; the generic `extern "C"` entries below
//! decode it (collecting every mismatch), fetch the state, and call the stage's method, all
//! inside the trampoline.

use std::marker::PhantomData;

use super::attrs::DecodeAttrs;
use super::buffer::{DecodeArgs, DecodeRets};
use super::context::Context;
use super::error::FfiResult;
use super::metadata::HandlerInfo;
use super::platform::Platform;
use super::stage::Stage;
use super::sys;
use super::trampoline::handle;
use super::types::{StateType, StateTypeRegistration};

/// The state a bundle's stages share: a [`StateType`] made by its instantiate stage, or
/// [`NoState`].
pub trait BundleState: Send + Sync + 'static {
    /// The registration of the state type; `None` for stateless bundles.
    fn state_registration() -> Option<&'static StateTypeRegistration>;
    /// The state of the executing call site.
    fn fetch<'a>(ctx: &Context<'a>) -> FfiResult<&'a Self>;
}

/// The state of a stateless bundle.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoState;

impl BundleState for NoState {
    fn state_registration() -> Option<&'static StateTypeRegistration> {
        None
    }
    fn fetch<'a>(_ctx: &Context<'a>) -> FfiResult<&'a Self> {
        Ok(&NoState)
    }
}

/// Handler traits, as XLA's bit set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Traits(pub sys::XLA_FFI_Handler_Traits);

impl Traits {
    /// No traits.
    pub const NONE: Traits = Traits(0);
    /// The execute stage only enqueues the same device work on every call (may be captured
    /// into a CUDA graph and replayed).
    pub const COMMAND_BUFFER_COMPATIBLE: Traits =
        Traits(sys::XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
}

/// An XLA FFI target: its name, platform, traits and the state its stages share.
pub trait Bundle: Sized + 'static {
    /// The custom-call target name.
    const TARGET: &'static str;
    /// The handler traits XLA is told of; none by default.
    const TRAITS: Traits = Traits::NONE;
    /// Where it runs: [`super::platform::Host`] (XLA:CPU; buffers are host memory and may be
    /// viewed as slices) or [`super::platform::Cuda`] (buffers are device addresses). It is
    /// registered for this platform only.
    type Platform: Platform;
    /// [`NoState`] for stateless bundles.
    type State: BundleState;
}

/// The instantiate stage: once per call site per executable, attributes and context only.
pub trait Instantiate: Bundle {
    /// The attributes this stage decodes (`()` ignores them).
    type Attrs<'a>: DecodeAttrs<'a>;
    /// Makes the call site's state, which is then handed to XLA to keep.
    fn instantiate(ctx: &Context<'_>, attrs: Self::Attrs<'_>) -> FfiResult<Self::State>;
}

/// The prepare stage: before each execution, to request resources.
pub trait Prepare: Bundle {
    /// The attributes this stage decodes (`()` ignores them).
    type Attrs<'a>: DecodeAttrs<'a>;
    /// Runs before each execution with the call site's state, e.g. to request resources.
    fn prepare(state: &Self::State, ctx: &Context<'_>, attrs: Self::Attrs<'_>) -> FfiResult<()>;
}

/// The initialize stage: before each execution, after resources were acquired. XLA:GPU passes
/// the call's buffers (shapes and dtypes are real; under command buffers the contents may not
/// be), so a stage can size per-device resources from them.
pub trait Initialize: Bundle {
    /// The arguments this stage decodes.
    type Args<'a>: DecodeArgs<'a, Self::Platform>;
    /// The results this stage decodes.
    type Rets<'a>: DecodeRets<'a, Self::Platform>;
    /// The attributes this stage decodes (`()` ignores them).
    type Attrs<'a>: DecodeAttrs<'a>;
    /// Runs before each execution with the state and the call's buffers.
    fn initialize(
        state: &Self::State,
        ctx: &Context<'_>,
        args: Self::Args<'_>,
        rets: Self::Rets<'_>,
        attrs: Self::Attrs<'_>,
    ) -> FfiResult<()>;
}

/// The execute stage: every call, possibly on many threads at once with the same state.
pub trait Execute: Bundle {
    /// The arguments this stage decodes.
    type Args<'a>: DecodeArgs<'a, Self::Platform>;
    /// The results this stage decodes.
    type Rets<'a>: DecodeRets<'a, Self::Platform>;
    /// The attributes this stage decodes (`()` ignores them).
    type Attrs<'a>: DecodeAttrs<'a>;
    /// Runs the operation: reads the arguments and writes the results.
    fn execute(
        state: &Self::State,
        ctx: &Context<'_>,
        args: Self::Args<'_>,
        rets: Self::Rets<'_>,
        attrs: Self::Attrs<'_>,
    ) -> FfiResult<()>;
}

pub(crate) const fn info<B: Bundle>(stage: Stage) -> HandlerInfo {
    HandlerInfo {
        target: B::TARGET,
        stage,
        traits: B::TRAITS.0,
        creates_state: None,
        keeps_stage_state: keeps_stage_state::<B>(),
    }
}

/// Whether XLA keeps prepare- and initialize-stage states for `B`'s calls: on a platform that
/// has them, and not for a command-buffer-compatible bundle, whose calls XLA:GPU may record
/// into a command buffer with no stage states at all (its `State_Get` there dereferences null).
const fn keeps_stage_state<B: Bundle>() -> bool {
    <B::Platform as Platform>::KEEPS_STAGE_STATE
        && B::TRAITS.0 & Traits::COMMAND_BUFFER_COMPATIBLE.0 == 0
}

unsafe extern "C" fn instantiate_entry<B: Instantiate>(
    frame: *mut sys::XLA_FFI_CallFrame,
) -> *mut sys::XLA_FFI_Error
where
    B::State: StateType,
{
    let info = HandlerInfo {
        creates_state: Some(B::State::registration()),
        ..info::<B>(Stage::Instantiate)
    };
    // SAFETY: XLA calls this entry with a call frame (the trampoline validates it).
    unsafe {
        handle(frame, &info, |frame| {
            let attrs = frame.decode_attrs::<B::Attrs<'_>>()?;
            let state = B::instantiate(frame.context(), attrs)?;
            frame.context().set_state(state)
        })
    }
}

unsafe extern "C" fn prepare_entry<B: Prepare>(
    frame: *mut sys::XLA_FFI_CallFrame,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA calls this entry with a call frame (the trampoline validates it).
    unsafe {
        handle(frame, &info::<B>(Stage::Prepare), |frame| {
            let attrs = frame.decode_attrs::<B::Attrs<'_>>()?;
            let state = B::State::fetch(frame.context())?;
            B::prepare(state, frame.context(), attrs)
        })
    }
}

unsafe extern "C" fn initialize_entry<B: Initialize>(
    frame: *mut sys::XLA_FFI_CallFrame,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA calls this entry with a call frame (the trampoline validates it).
    unsafe {
        handle(frame, &info::<B>(Stage::Initialize), |frame| {
            let (args, rets, attrs) =
                frame.decode_all::<B::Platform, B::Args<'_>, B::Rets<'_>, B::Attrs<'_>>()?;
            let state = B::State::fetch(frame.context())?;
            B::initialize(state, frame.context(), args, rets, attrs)
        })
    }
}

unsafe extern "C" fn execute_entry<B: Execute>(
    frame: *mut sys::XLA_FFI_CallFrame,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA calls this entry with a call frame (the trampoline validates it).
    unsafe {
        handle(frame, &info::<B>(Stage::Execute), |frame| {
            let (args, rets, attrs) =
                frame.decode_all::<B::Platform, B::Args<'_>, B::Rets<'_>, B::Attrs<'_>>()?;
            let state = B::State::fetch(frame.context())?;
            B::execute(state, frame.context(), args, rets, attrs)
        })
    }
}

/// A bundle ready to register: its target, platform, traits, state type and stage handlers.
#[derive(Clone, Copy)]
pub struct BundleDef {
    /// The custom-call target name.
    pub target: &'static str,
    /// The platform name JAX registers it for ("cpu", "cuda").
    pub platform: &'static str,
    /// The handler traits XLA is told of.
    pub traits: Traits,
    /// The state type, which must be registered with XLA before the bundle.
    pub state: fn() -> Option<&'static StateTypeRegistration>,
    /// The other types its stages store or look up, registered with XLA with the state type.
    pub stage_types: StageTypes,
    /// The stage entries XLA calls; a stage the bundle does not have is `None`.
    pub handlers: sys::XLA_FFI_Handler_Bundle,
}

/// The types a bundle's stages keep besides the instantiate state, declared on its
/// [`BundleBuilder`] so that they are registered with XLA (which assigns their ids) with the
/// bundle: the prepare- and initialize-stage states ([`Context::set_stage_state`]) and the user
/// data it reads ([`Context::user_data`]).
#[derive(Clone, Copy, Default)]
pub struct StageTypes {
    /// The prepare stage's state type.
    pub prepare: Option<fn() -> &'static StateTypeRegistration>,
    /// The initialize stage's state type.
    pub initialize: Option<fn() -> &'static StateTypeRegistration>,
    /// The user-data type.
    pub user_data: Option<fn() -> &'static StateTypeRegistration>,
}

impl StageTypes {
    const NONE: StageTypes = StageTypes {
        prepare: None,
        initialize: None,
        user_data: None,
    };
}

impl BundleDef {
    /// Starts the declaration of `B`'s bundle.
    pub const fn of<B: Bundle>() -> BundleBuilder<B> {
        BundleBuilder {
            handlers: sys::XLA_FFI_Handler_Bundle {
                instantiate: None,
                prepare: None,
                initialize: None,
                execute: None,
            },
            stage_types: StageTypes::NONE,
            _bundle: PhantomData,
        }
    }

    /// Every type XLA must know before this bundle is registered, each once: the state type,
    /// then the stage states and the user data.
    pub fn types(&self) -> Vec<&'static StateTypeRegistration> {
        let t = &self.stage_types;
        let mut types: Vec<&'static StateTypeRegistration> = Vec::new();
        let declared = [t.prepare, t.initialize, t.user_data];
        for registration in (self.state)()
            .into_iter()
            .chain(declared.into_iter().flatten().map(|f| f()))
        {
            if !types.iter().any(|r| std::ptr::eq(*r, registration)) {
                types.push(registration);
            }
        }
        types
    }

    /// The stages this bundle defines, with their handlers.
    pub fn stages(&self) -> Vec<(Stage, sys::XLA_FFI_Handler)> {
        let h = &self.handlers;
        [
            (Stage::Instantiate, h.instantiate),
            (Stage::Prepare, h.prepare),
            (Stage::Initialize, h.initialize),
            (Stage::Execute, h.execute),
        ]
        .into_iter()
        .filter_map(|(stage, handler)| handler.map(|f| (stage, f)))
        .collect()
    }

    /// The handler of one stage.
    pub fn handler(&self, stage: Stage) -> Option<sys::XLA_FFI_Handler> {
        self.stages()
            .into_iter()
            .find(|(s, _)| *s == stage)
            .map(|(_, f)| f)
    }
}

/// Collects the stages of `B`; each method exists only if `B` implements that stage.
pub struct BundleBuilder<B: Bundle> {
    pub(crate) handlers: sys::XLA_FFI_Handler_Bundle,
    stage_types: StageTypes,
    _bundle: PhantomData<B>,
}

impl<B: Instantiate> BundleBuilder<B>
where
    B::State: StateType,
{
    /// Adds the instantiate stage.
    pub const fn instantiate(mut self) -> Self {
        self.handlers.instantiate = Some(instantiate_entry::<B>);
        self
    }
}

impl<B: Prepare> BundleBuilder<B> {
    /// Adds the prepare stage.
    pub const fn prepare(mut self) -> Self {
        self.handlers.prepare = Some(prepare_entry::<B>);
        self
    }

    /// Declares `T` as the state the prepare stage stores ([`Context::set_stage_state`]), so
    /// that it is registered with XLA with the bundle. Only where XLA keeps such states: not
    /// on XLA:CPU, not for a [`Traits::COMMAND_BUFFER_COMPATIBLE`] bundle (a compile error for
    /// a `const` declaration).
    pub const fn prepare_state<T: StateType>(mut self) -> Self {
        assert!(
            keeps_stage_state::<B>(),
            "XLA keeps no prepare-stage state for this bundle: XLA:CPU runs no prepare stage, \
             and XLA:GPU keeps none for a command-buffer-compatible bundle"
        );
        self.stage_types.prepare = Some(T::registration);
        self
    }
}

impl<B: Initialize> BundleBuilder<B> {
    /// Adds the initialize stage.
    pub const fn initialize(mut self) -> Self {
        self.handlers.initialize = Some(initialize_entry::<B>);
        self
    }

    /// Declares `T` as the state the initialize stage stores, as
    /// [`BundleBuilder::prepare_state`] does for the prepare stage.
    pub const fn initialize_state<T: StateType>(mut self) -> Self {
        assert!(
            keeps_stage_state::<B>(),
            "XLA keeps no initialize-stage state for this bundle: XLA:CPU runs no initialize stage, \
             and XLA:GPU keeps none for a command-buffer-compatible bundle"
        );
        self.stage_types.initialize = Some(T::registration);
        self
    }
}

impl<B: Execute> BundleBuilder<B> {
    /// Adds the execute stage.
    pub const fn execute(mut self) -> Self {
        self.handlers.execute = Some(execute_entry::<B>);
        self
    }
}

impl<B: Bundle> BundleBuilder<B> {
    /// Declares `T` as the type of the user data the stages read ([`Context::user_data`]),
    /// so that it is registered with XLA with the bundle.
    pub const fn user_data<T: StateType>(mut self) -> Self {
        self.stage_types.user_data = Some(T::registration);
        self
    }

    /// Finishes the declaration. A stateful bundle must have an instantiate stage (it is the
    /// only stage that makes the state) and every bundle an execute stage (XLA requires one);
    /// both are checked at compile time when the declaration is a `const`.
    pub const fn build(self) -> BundleDef {
        assert!(
            self.handlers.execute.is_some(),
            "a bundle needs an execute stage"
        );
        BundleDef {
            target: B::TARGET,
            platform: <B::Platform as Platform>::NAME,
            traits: B::TRAITS,
            state: B::State::state_registration,
            stage_types: self.stage_types,
            handlers: self.handlers,
        }
    }
}

/// Checks a declared bundle: a stateful one must define the stage that makes its state.
pub fn check_bundle(def: &BundleDef) -> Result<(), String> {
    if (def.state)().is_some() && def.handlers.instantiate.is_none() {
        return Err(format!(
            "bundle `{}` has a state type but no instantiate stage to make it",
            def.target
        ));
    }
    Ok(())
}

/// Declares that a Rust type is an XLA FFI state type called `$name` in XLA's registry.
///
/// ```text
/// struct MyState { table: Vec<f32> }
/// xla_ffi_bundles::state_type!(MyState, "my_crate.MyState");
/// ```
#[macro_export]
macro_rules! state_type {
    ($ty:ty, $name:expr) => {
        impl $crate::ffi::types::StateType for $ty {
            fn registration() -> &'static $crate::ffi::types::StateTypeRegistration {
                static REGISTRATION: $crate::ffi::types::StateTypeRegistration =
                    $crate::ffi::types::StateTypeRegistration::new::<$ty>($name);
                &REGISTRATION
            }
        }

        impl $crate::ffi::bundle::BundleState for $ty {
            fn state_registration(
            ) -> ::std::option::Option<&'static $crate::ffi::types::StateTypeRegistration> {
                ::std::option::Option::Some(<$ty as $crate::ffi::types::StateType>::registration())
            }
            fn fetch<'a>(
                ctx: &$crate::ffi::context::Context<'a>,
            ) -> $crate::ffi::error::FfiResult<&'a Self> {
                ctx.state::<$ty>()
            }
        }
    };
}
