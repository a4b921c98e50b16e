//! The `rmsnorm_ffi._native` extension module: capsules for registration, library tables, the
//! op contract and statistics.
//!
//! Registration itself happens in Python (`rmsnorm_ffi.register()` and `register_library()`),
//! which must control the order (backend first, then types, then bundles); this module only
//! hands out the pieces: the extension's own table and any library's, read the same way
//! (`ffi::library`), as `{"bundles": [...], "state_types": {...}}` descriptions.

use std::path::Path;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::handlers;
use crate::handlers::contract::{self as op_contract, DtypePair};
use xla_ffi_bundles::ffi::capsule;
use xla_ffi_bundles::ffi::library::{self, Library, LibraryError};
use xla_ffi_bundles::ffi::sys::{XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
use xla_ffi_bundles::ffi::DataType;

fn platform_error(e: handlers::HandlerError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// `{target: {stage: capsule}}` for the bundles of `platform`.
#[pyfunction]
#[pyo3(signature = (platform = "cpu"))]
fn registrations<'py>(py: Python<'py>, platform: &str) -> PyResult<Bound<'py, PyDict>> {
    handlers::check_all().map_err(PyValueError::new_err)?;
    let out = PyDict::new(py);
    for def in handlers::bundles(platform).map_err(platform_error)? {
        let stages = PyDict::new(py);
        for (stage, handler) in def.stages() {
            stages.set_item(stage.name(), capsule::handler(py, handler)?)?;
        }
        out.set_item(def.target, stages)?;
    }
    Ok(out)
}

/// `{name: {"type_id": capsule, "type_info": capsule}}` for the state types of `platform`.
#[pyfunction]
#[pyo3(signature = (platform = "cpu"))]
fn state_types<'py>(py: Python<'py>, platform: &str) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for registration in handlers::state_types(platform).map_err(platform_error)? {
        let (type_id, type_info) = capsule::state_type(py, registration)?;
        let entry = PyDict::new(py);
        entry.set_item("type_id", type_id)?;
        entry.set_item("type_info", type_info)?;
        out.set_item(registration.name(), entry)?;
    }
    Ok(out)
}

/// The type ids XLA assigned so far (0: not registered yet), by state type name.
#[pyfunction]
#[pyo3(signature = (platform = "cpu"))]
fn type_ids<'py>(py: Python<'py>, platform: &str) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for registration in handlers::state_types(platform).map_err(platform_error)? {
        out.set_item(registration.name(), registration.type_id())?;
    }
    Ok(out)
}

/// The platforms this build has bundles for.
#[pyfunction]
fn platforms() -> Vec<&'static str> {
    handlers::PLATFORMS.to_vec()
}

/// `{"origin", "crate_version", "xla_api_version", "bundles": [{"target", "platform", "traits",
/// "stages": {stage: capsule}, "state_type": name or None}], "state_types": {name: {"type_id":
/// capsule, "type_info": capsule}}}` for a checked table.
fn describe<'py>(py: Python<'py>, table: &Library) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("origin", &table.origin)?;
    out.set_item("crate_version", &table.crate_version)?;
    out.set_item("xla_api_version", table.xla_api_version)?;
    let bundles = PyList::empty(py);
    for bundle in &table.bundles {
        let d = PyDict::new(py);
        d.set_item("target", &bundle.target)?;
        d.set_item("platform", bundle.platform)?;
        d.set_item("traits", bundle.traits)?;
        let stages = PyDict::new(py);
        for (stage, handler) in &bundle.stages {
            stages.set_item(stage.name(), capsule::handler(py, handler.0)?)?;
        }
        d.set_item("stages", stages)?;
        let state = bundle
            .state_type
            .map(|i| table.state_types[i].name.as_str());
        d.set_item("state_type", state)?;
        bundles.append(d)?;
    }
    out.set_item("bundles", bundles)?;
    let types = PyDict::new(py);
    for t in &table.state_types {
        let (type_id, type_info) = capsule::library_state_type(py, t.type_id, t.type_info)?;
        let entry = PyDict::new(py);
        entry.set_item("type_id", type_id)?;
        entry.set_item("type_info", type_info)?;
        types.set_item(&t.name, entry)?;
    }
    out.set_item("state_types", types)?;
    Ok(out)
}

fn library_error(e: LibraryError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The extension's own bundles and state types, as [`load_library`] describes a library's.
#[pyfunction]
fn product(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let table = library::read_own(&handlers::TABLE, "rmsnorm_ffi").map_err(library_error)?;
    describe(py, &table)
}

/// Loads the shared library at `path` (a library built on this crate, exporting its table with
/// `export_library!`), checks its table, makes it report its states into this extension's
/// registry, and describes its bundles and state types. Once per library; ValueError naming
/// the problem for anything else.
#[pyfunction]
fn load_library<'py>(py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyDict>> {
    let table = library::load(Path::new(path), &xla_ffi_bundles::state::registry::HOOKS)
        .map_err(library_error)?;
    describe(py, table)
}

/// NumPy's name for a dtype of the op contract.
fn numpy_name(d: DataType) -> PyResult<&'static str> {
    match d {
        DataType::F32 => Ok("float32"),
        DataType::F64 => Ok("float64"),
        DataType::BF16 => Ok("bfloat16"),
        DataType::F16 => Ok("float16"),
        other => Err(PyValueError::new_err(format!(
            "{other} has no NumPy name here (not a dtype of the op contract)"
        ))),
    }
}

/// The op contract of the RMS norm targets (`handlers::contract`), for the Python checks:
/// `{"forward_target", "backward_target", "max_row_len", "dtype_pairs": [{"x", "weight",
/// "accumulation"}, ...]}` with NumPy dtype names, pairs in the contract's order.
#[pyfunction]
fn contract(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("forward_target", op_contract::FORWARD_TARGET)?;
    out.set_item("backward_target", op_contract::BACKWARD_TARGET)?;
    out.set_item("residual_target", op_contract::RESIDUAL_TARGET)?;
    out.set_item("max_row_len", op_contract::MAX_ROW_LEN)?;
    let pairs = PyList::empty(py);
    for pair in DtypePair::ALL {
        let d = PyDict::new(py);
        d.set_item("x", numpy_name(pair.x())?)?;
        d.set_item("weight", numpy_name(pair.weight())?)?;
        d.set_item("accumulation", numpy_name(pair.accumulation())?)?;
        pairs.append(d)?;
    }
    out.set_item("dtype_pairs", pairs)?;
    // Each norm's `norm` attribute and its statistics, in the order the targets take them.
    let norms = PyDict::new(py);
    for (value, name) in op_contract::Norm::VALUES {
        let norm = op_contract::Norm::from_value(*value).expect("a listed value");
        let d = PyDict::new(py);
        d.set_item("value", *value as i64)?;
        d.set_item("statistics", norm.statistics().to_vec())?;
        norms.set_item(name.to_ascii_lowercase(), d)?;
    }
    out.set_item("norms", norms)?;
    // The `split` attribute's values (a split row's passes), by name.
    let splits = PyDict::new(py);
    for (value, name) in op_contract::Split::VALUES {
        splits.set_item(*name, *value as i64)?;
    }
    out.set_item("splits", splits)?;
    Ok(out)
}

/// A snapshot of the live-state registry.
#[pyfunction]
fn stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = xla_ffi_bundles::state::snapshot();
    let out = PyDict::new(py);
    out.set_item("live_states", s.live_states)?;
    out.set_item("created_states", s.created_states)?;
    out.set_item("destroyed_states", s.destroyed_states)?;
    let executions = PyDict::new(py);
    for (target, n) in &s.executions {
        executions.set_item(*target, *n)?;
    }
    out.set_item("executions", executions)?;
    out.set_item("workspace_bytes", s.workspace_bytes)?;
    out.set_item("workspace_allocations", s.workspace_allocations)?;
    let states = PyList::empty(py);
    for state in &s.states {
        let d = PyDict::new(py);
        d.set_item("id", state.id)?;
        d.set_item("target", state.target)?;
        d.set_item("type", state.type_name)?;
        d.set_item("executions", state.executions)?;
        let details = PyDict::new(py);
        for (k, v) in &state.details {
            details.set_item(k, v)?;
        }
        d.set_item("details", details)?;
        states.append(d)?;
    }
    out.set_item("states", states)?;
    out.set_item(
        "gpu_modules_loaded",
        crate::handlers::gpu::resources::modules_loaded(),
    )?;
    Ok(out)
}

/// What the CUDA path found, for diagnostics (bench/gpu_check.py): where libcuda and NVRTC were
/// loaded from, NVRTC's version, and per device its compute capability, SMs and L2 bytes; a
/// library that could not be loaded gives its error message instead.
#[pyfunction]
fn gpu_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    use crate::handlers::gpu::driver;
    let out = PyDict::new(py);
    match driver::nvrtc() {
        Ok(nvrtc) => {
            out.set_item("nvrtc", nvrtc.path())?;
            out.set_item("nvrtc_version", nvrtc.version())?;
        }
        Err(e) => out.set_item("nvrtc_error", e.to_string())?,
    }
    out.set_item("nvrtc_lineinfo", driver::nvrtc::lineinfo_requested())?;
    match driver::cuda() {
        Ok(cuda) => {
            out.set_item("libcuda", cuda.path())?;
            let devices = PyList::empty(py);
            for ordinal in 0..cuda.device_count().unwrap_or(0) {
                let d = PyDict::new(py);
                d.set_item("ordinal", ordinal)?;
                if let Ok(cc) = cuda.capability(ordinal) {
                    d.set_item("compute_capability", cc)?;
                }
                if let Ok(sms) = cuda.sm_count(ordinal) {
                    d.set_item("sm_count", sms)?;
                }
                if let Ok(l2) = cuda.l2_bytes(ordinal) {
                    d.set_item("l2_bytes", l2)?;
                }
                devices.append(d)?;
            }
            out.set_item("devices", devices)?;
        }
        Err(e) => out.set_item("libcuda_error", e.to_string())?,
    }
    out.set_item(
        "gpu_modules_loaded",
        crate::handlers::gpu::resources::modules_loaded(),
    )?;
    Ok(out)
}

/// The canonical form of a `RMSNORM_FFI_GPU_PLAN` value (the CUDA kernel-variant knob,
/// `handlers::gpu::variant`), checked without a GPU: `"default"` for the default plan.
/// `ValueError` names the bad key or value.
#[pyfunction]
fn parse_gpu_plan(text: &str) -> PyResult<String> {
    crate::handlers::gpu::variant::Variant::parse(text)
        .map(|v| v.to_string())
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("RMSNORM_FFI_GPU_PLAN: {e}")))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(registrations, m)?)?;
    m.add_function(wrap_pyfunction!(state_types, m)?)?;
    m.add_function(wrap_pyfunction!(type_ids, m)?)?;
    m.add_function(wrap_pyfunction!(platforms, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(contract, m)?)?;
    m.add_function(wrap_pyfunction!(product, m)?)?;
    m.add_function(wrap_pyfunction!(load_library, m)?)?;
    m.add(
        "LIBRARY_ABI_VERSION",
        xla_ffi_bundles::ffi::export::LIBRARY_ABI_VERSION,
    )?;
    m.add_function(wrap_pyfunction!(gpu_info, m)?)?;
    m.add_function(wrap_pyfunction!(parse_gpu_plan, m)?)?;
    // The oldest XLA FFI API version the handlers run on (0.3); at registration they report the
    // newest that both they and the runtime speak (0.5 to jaxlib 0.12).
    m.add(
        "XLA_FFI_API_VERSION",
        (XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR),
    )?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The framework's version, which libraries registered here must have been built with.
    m.add("FRAMEWORK_VERSION", xla_ffi_bundles::VERSION)?;
    Ok(())
}
