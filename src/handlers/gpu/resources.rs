//! What the GPU bundles hold on a device, and where it is shared.
//!
//! - The **module** (a norm's compiled kernels loaded into a device's primary context, ~640 KB)
//!   is loaded once per CUDA device and norm per process and shared by every state of every
//!   call site of that norm: it is the same code for all of them. It stays loaded for the life
//!   of the process.
//! - The **scratch** (the backward's weight-gradient partials, and a cluster launch's
//!   dot-product slots) belongs to one state on one
//!   device: two executables may run on different streams of a device at once, so states must
//!   not share it. It is sized to what the call site's launches use, and its address stays
//!   fixed for the life of the state (CUDA graphs that captured a launch keep using it).
//!
//! Devices are keyed by the CUDA device of the call's stream (`cuStreamGetCtx` +
//! `cuCtxGetDevice`), not by XLA's device ordinal, which need not be CUDA's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use dashmap::DashMap;
use once_cell::sync::{Lazy, OnceCell};

use super::driver::{self, CaptureStatus, DeviceAllocation, Module, StreamDevice};
use super::kernels;
use super::plan;
use super::variant::Variant;
use crate::handlers::contract::Norm;
use xla_ffi_bundles::ffi::{FfiError, FfiResult, Stage, Stream};
use xla_ffi_bundles::state::LiveState;

type Cell<T> = Arc<OnceCell<T>>;

/// A module's key: the CUDA device, the variant's defines ([`Variant::defines`]) and the norm.
type ModuleKey = (i32, String, Norm);
static MODULES: Lazy<DashMap<ModuleKey, Cell<Arc<Module>>>> = Lazy::new(DashMap::new);
static MODULES_LOADED: AtomicUsize = AtomicUsize::new(0);

/// Modules loaded in this process (one per CUDA device used, norm used and set of variant
/// defines: one per device and norm without `RMSNORM_FFI_GPU_PLAN`).
pub fn modules_loaded() -> usize {
    MODULES_LOADED.load(Ordering::Relaxed)
}

/// The norm's kernels of `variant` loaded on CUDA device `device`: loaded on first use
/// (concurrent callers wait for the first), then shared by every state of the norm whose
/// variant has the same defines (one module per device and norm for the default plan).
pub fn module_for(device: i32, variant: &Variant, norm: Norm) -> FfiResult<Arc<Module>> {
    let cell = MODULES
        .entry((device, variant.defines(), norm))
        .or_default()
        .clone();
    let module = cell.get_or_try_init(|| -> FfiResult<Arc<Module>> {
        let cuda = driver::cuda()?;
        let compiled = kernels::compiled_for(cuda.capability(device)?, variant, norm)?;
        let module = Module::load(device, &compiled.image(), kernels::table(norm))?;
        MODULES_LOADED.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(module))
    })?;
    Ok(Arc::clone(module))
}

/// One state's resources on one device.
pub struct DeviceSlot {
    pub module: Arc<Module>,
    pub scratch: Option<DeviceAllocation>,
    pub sm_count: usize,
    /// Most blocks per thread block cluster the device's launches may take (plan.rs's
    /// `max_cluster`): [`plan::MAX_CLUSTER`] where it has clusters, else 1.
    pub max_cluster: usize,
}

impl DeviceSlot {
    /// The scratch's address and size (0, 0 without).
    pub fn scratch(&self) -> (u64, usize) {
        self.scratch
            .as_ref()
            .map_or((0, 0), |s| (s.addr(), s.bytes()))
    }
}

/// One state's resources, per CUDA device.
#[derive(Default)]
pub struct DeviceSlots {
    by_device: DashMap<i32, Cell<DeviceSlot>>,
}

impl DeviceSlots {
    /// The resources for the call's `stream` on `device`, acquired now if this is the first
    /// call there (`stage` says which stage did, for `stats()`): the shared module of the
    /// state's kernels (its variant and norm), and `scratch_bytes(sm_count, max_cluster)` (0:
    /// none) of scratch.
    ///
    /// Acquiring is not legal while the stream is being captured into a CUDA graph (XLA runs
    /// initialize before it records, so this only happens if it did not): then this fails with
    /// a clear error before any driver call that would invalidate the capture.
    pub fn get_or_acquire(
        &self,
        live: &LiveState,
        stream: Stream,
        device: &StreamDevice,
        stage: Stage,
        (variant, norm): (&Variant, Norm),
        scratch_bytes: impl FnOnce(usize, usize) -> usize,
    ) -> FfiResult<Cell<DeviceSlot>> {
        let cell = match self.by_device.get(&device.device) {
            Some(c) => c.clone(),
            None => self.by_device.entry(device.device).or_default().clone(),
        };
        if cell.get().is_none() {
            let cuda = driver::cuda()?;
            if cuda.capture_status(stream)? != CaptureStatus::None {
                return Err(FfiError::failed_precondition(format!(
                    "rmsnorm_ffi: `{}` was asked to run on CUDA device {} while its stream is \
                     being captured into a CUDA graph, but its GPU resources were never loaded \
                     there (XLA did not run the initialize stage first). Loading them now would \
                     invalidate the capture; run the executable once without command buffers, \
                     or use an XLA that runs initialize before recording.",
                    live.target(),
                    device.device
                )));
            }
        }
        cell.get_or_try_init(|| -> FfiResult<DeviceSlot> {
            let module = module_for(device.device, variant, norm)?;
            let cuda = driver::cuda()?;
            let sm_count = cuda.sm_count(device.device)?.max(1) as usize;
            let max_cluster = if cuda.has_clusters(device.device)? {
                plan::MAX_CLUSTER
            } else {
                1
            };
            let scratch_bytes = scratch_bytes(sm_count, max_cluster);
            let scratch = if scratch_bytes > 0 {
                Some(DeviceAllocation::new(&module, scratch_bytes)?)
            } else {
                None
            };
            live.set_detail(
                format!("cuda device {}", device.device),
                format!("resources loaded in {stage}, {scratch_bytes} scratch bytes"),
            );
            Ok(DeviceSlot {
                module,
                scratch,
                sm_count,
                max_cluster,
            })
        })?;
        if !cell.get().is_some_and(|slot| slot.module.serves(device)) {
            return Err(FfiError::failed_precondition(format!(
                "rmsnorm_ffi: the stream of this call belongs to a context other than CUDA device \
                 {}'s primary context, where the kernels are loaded",
                device.device
            )));
        }
        Ok(cell)
    }
}
