//! Where a bundle runs, and so what its buffers' addresses mean.
//!
//! XLA:CPU hands a handler host memory, which Rust may view as slices; XLA:GPU hands it device
//! addresses, which the CPU must never dereference: a `&[f32]` over device memory is undefined
//! behaviour even if it is never read. So every [`super::bundle::Bundle`] names its platform, the
//! buffer types carry it ([`super::buffer::AnyBuffer<'a, P>`]), and the typed slice views
//! exist only for [`Host`], while device platforms get their addresses
//! ([`super::buffer::AnyBuffer::device_ptr`]). Taking a host slice in a CUDA bundle is a
//! compile error, not a run-time check.
//!
//! A leaf of the FFI layer: markers only.

mod sealed {
    pub trait Sealed {}
}

/// A platform a bundle can be registered for. Sealed: the buffer layer's soundness depends on
/// knowing which platforms hand out host memory.
pub trait Platform: sealed::Sealed + Send + Sync + 'static {
    /// The name JAX registers targets under (`jax.ffi.register_ffi_target(..., platform=)`).
    const NAME: &'static str;
    /// Whether XLA runs the prepare and initialize stages here and keeps a state for each
    /// (XLA:GPU does, per execution). XLA:CPU runs instantiate and execute only, and its
    /// `XLA_FFI_State_Set`/`Get` for those stages dereference a null pointer, so the context
    /// refuses them itself ([`super::context::Context::stage_state`]).
    const KEEPS_STAGE_STATE: bool;
}

/// A platform whose buffers are device memory: addresses only, no slices.
pub trait Device: Platform {}

/// The host (XLA:CPU): buffers are host memory, viewable as slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {}

/// NVIDIA GPUs (XLA:GPU with CUDA): buffers are device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cuda {}

impl sealed::Sealed for Host {}
impl sealed::Sealed for Cuda {}

impl Platform for Host {
    const NAME: &'static str = "cpu";
    const KEEPS_STAGE_STATE: bool = false;
}

impl Platform for Cuda {
    const NAME: &'static str = "cuda";
    const KEEPS_STAGE_STATE: bool = true;
}

impl Device for Cuda {}

/// The names of every platform this crate can declare bundles for.
pub const NAMES: [&str; 2] = [Host::NAME, Cuda::NAME];
