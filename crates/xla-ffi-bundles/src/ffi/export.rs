//! A library's table: every bundle and state type of a shared library built on this crate, as
//! plain C data behind one exported symbol.
//!
//! A crate that builds its own `cdylib` on top of this one declares its bundles as usual and
//! exports them all with one [`crate::export_library!`]; `rmsnorm_ffi.register_library(path)`
//! loads the library, reads the table ([`super::library`]) and registers everything in it in
//! XLA's order (`examples/counter_bundle/` is the complete example).
//!
//! The table starts with a [`LibraryHeader`] whose layout never changes: a magic number, the
//! table's ABI version ([`LIBRARY_ABI_VERSION`]) and the version of this crate the library was
//! built with. A reader checks the header before it reads anything else, so a library built
//! against another version of this crate is refused with a message that says so, instead of
//! being misread. Everything the table points to lives for the rest of the process: code, the
//! type infos, the type id cells that XLA writes at type registration, and the strings, which
//! the table owns.

use std::ffi::{c_char, CString};
use std::ptr;

use super::bundle::{check_bundle, BundleDef};
use super::host::{self, RegistryHooks};
use super::platform;
use super::sys;
use super::types::StateTypeRegistration;

/// The symbol a library exports its table under.
pub const LIBRARY_SYMBOL: &str = "xla_ffi_bundles_library";
/// The first bytes of every table.
pub const LIBRARY_MAGIC: [u8; 8] = *b"RMSNFFI\0";
/// The version of the table's layout and meaning (everything after the header, and
/// [`RegistryHooks`]). A reader accepts only its own; bump it with any change to those.
pub const LIBRARY_ABI_VERSION: u32 = 2;

/// The stable start of a library table, the same in every version of this crate.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LibraryHeader {
    /// [`LIBRARY_MAGIC`], which marks a table of this crate.
    pub magic: [u8; 8],
    /// The table's [`LIBRARY_ABI_VERSION`]; a reader accepts only its own.
    pub abi_version: u32,
    /// Size of the whole [`LibraryExport`] this header starts.
    pub struct_size: u32,
    /// The version of `xla-ffi-bundles` the library was built with, NUL-terminated.
    pub crate_version: *const c_char,
}

/// One bundle: its target, platform, traits, stage handlers and state type.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BundleExport {
    /// The target name, NUL-terminated.
    pub target: *const c_char,
    /// The platform JAX registers it for ("cpu", "cuda"), NUL-terminated.
    pub platform: *const c_char,
    /// The handler traits XLA is told of.
    pub traits: sys::XLA_FFI_Handler_Traits,
    /// The stage handlers; a stage the bundle does not have is null.
    pub handlers: sys::XLA_FFI_Handler_Bundle,
    /// Index of its state type in the table's state types, or -1 for a stateless bundle.
    pub state_type: i64,
}

/// One state type: what `jax.ffi.register_ffi_type` takes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct StateTypeExport {
    /// The name in XLA's process-wide type registry, NUL-terminated.
    pub name: *const c_char,
    /// The id cell XLA fills in at type registration (the `"type_id"` capsule).
    pub type_id: *mut sys::XLA_FFI_TypeId,
    /// The type info with the deleter (the `"type_info"` capsule).
    pub type_info: *const sys::XLA_FFI_TypeInfo,
}

/// The whole table.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LibraryExport {
    /// The stable start, checked before anything else is read.
    pub header: LibraryHeader,
    /// Why the table is empty, NUL-terminated, or null: a library whose declarations are
    /// inconsistent exports the reason instead of bundles.
    pub error: *const c_char,
    /// The oldest XLA FFI API version the library's handlers run on (0.3); they report the
    /// newest that both they and the runtime speak ([`super::metadata::reported_minor`]).
    pub xla_api_major: i32,
    /// The minor part of that version.
    pub xla_api_minor: i32,
    /// The bundles, `bundle_count` of them.
    pub bundles: *const BundleExport,
    /// The number of bundles.
    pub bundle_count: usize,
    /// The state types that the bundles' `state_type` indices name, `state_type_count` of them.
    pub state_types: *const StateTypeExport,
    /// The number of state types.
    pub state_type_count: usize,
    /// Makes the library report its states into the caller's registry ([`super::host`]);
    /// returns null on success, else a NUL-terminated reason that lives for the process.
    pub attach_registry: unsafe extern "C" fn(hooks: *const RegistryHooks) -> *const c_char,
}

/// Why [`LibraryTable::new`] refused a list of bundles.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    /// A bundle failed its own check (a state type but no instantiate stage).
    #[error("{0}")]
    Bundle(String),
    /// A name contains a NUL byte, so it cannot be a C string.
    #[error("the {what} `{name}` contains a NUL byte")]
    Nul {
        /// What the name is of ("target", "platform", "state type").
        what: &'static str,
        /// The name.
        name: String,
    },
    /// Two bundles have the same target on the same platform.
    #[error("target `{target}` is declared twice for platform `{platform}`")]
    DuplicateTarget {
        /// The target name.
        target: String,
        /// The platform both are declared for.
        platform: String,
    },
    /// Two different state types have the same name.
    #[error("two different state types are both called `{0}`")]
    DuplicateStateType(String),
    /// A bundle names a platform this crate does not know.
    #[error("bundle `{target}` names platform `{platform}`, which this crate does not know")]
    Platform {
        /// The bundle's target name.
        target: String,
        /// The unknown platform name.
        platform: String,
    },
}

/// A [`LibraryExport`] with everything it points to. Build it once, keep it for the process
/// (which [`crate::export_library!`] does).
pub struct LibraryTable {
    export: LibraryExport,
    _bundles: Vec<BundleExport>,
    _state_types: Vec<StateTypeExport>,
    _strings: Vec<CString>,
}

// SAFETY: the table is never mutated after `new`; its pointers are to code, to `'static` type
// infos and id cells (atomic, written by XLA once), and to the strings and vectors it owns,
// whose heap buffers do not move.
unsafe impl Send for LibraryTable {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for LibraryTable {}

fn c_string(
    strings: &mut Vec<CString>,
    what: &'static str,
    name: &str,
) -> Result<*const c_char, ExportError> {
    let owned = CString::new(name).map_err(|_| ExportError::Nul {
        what,
        name: name.into(),
    })?;
    let pointer = owned.as_ptr();
    strings.push(owned);
    Ok(pointer)
}

impl LibraryTable {
    /// The table of `defs`, checked: each stateful bundle has the stage that makes its state,
    /// targets are unique per platform, state types unique by name, platforms known.
    pub fn new(defs: &[BundleDef]) -> Result<LibraryTable, ExportError> {
        let mut strings = Vec::new();
        let crate_version = c_string(&mut strings, "version", env!("CARGO_PKG_VERSION"))?;
        let mut types: Vec<&'static StateTypeRegistration> = Vec::new();
        let mut bundles = Vec::with_capacity(defs.len());
        for (i, def) in defs.iter().enumerate() {
            check_bundle(def).map_err(ExportError::Bundle)?;
            if !platform::NAMES.contains(&def.platform) {
                return Err(ExportError::Platform {
                    target: def.target.into(),
                    platform: def.platform.into(),
                });
            }
            if defs[..i]
                .iter()
                .any(|d| d.target == def.target && d.platform == def.platform)
            {
                return Err(ExportError::DuplicateTarget {
                    target: def.target.into(),
                    platform: def.platform.into(),
                });
            }
            // The bundle's state type first (its index goes in the entry), then the types its
            // stages keep besides (stage states, user data): in the table's list too, which a
            // reader registers whether or not a bundle names them.
            let mut state_type = -1;
            for registration in def.types() {
                let index = match types.iter().position(|t| t.name() == registration.name()) {
                    Some(index) if ptr::eq(types[index], registration) => index,
                    Some(_) => {
                        return Err(ExportError::DuplicateStateType(registration.name().into()))
                    }
                    None => {
                        types.push(registration);
                        types.len() - 1
                    }
                };
                if (def.state)().is_some_and(|s| ptr::eq(s, registration)) {
                    state_type = index as i64;
                }
            }
            bundles.push(BundleExport {
                target: c_string(&mut strings, "target", def.target)?,
                platform: c_string(&mut strings, "platform", def.platform)?,
                traits: def.traits.0,
                handlers: def.handlers,
                state_type,
            });
        }
        let state_types = types
            .iter()
            .map(|t| {
                Ok(StateTypeExport {
                    name: c_string(&mut strings, "state type", t.name())?,
                    type_id: t.type_id_ptr(),
                    type_info: t.type_info_ptr(),
                })
            })
            .collect::<Result<Vec<_>, ExportError>>()?;
        Ok(Self::assemble(
            crate_version,
            ptr::null(),
            bundles,
            state_types,
            strings,
        ))
    }

    /// A table without bundles that carries `error`, for a library whose declarations are
    /// inconsistent: the reader reports it.
    pub fn failed(error: &ExportError) -> LibraryTable {
        let mut strings = Vec::new();
        let message = error.to_string().replace('\0', "\\0");
        let crate_version = c_string(&mut strings, "version", env!("CARGO_PKG_VERSION"))
            .expect("the crate version has no NUL");
        let error = c_string(&mut strings, "error", &message).expect("NULs were escaped");
        Self::assemble(crate_version, error, Vec::new(), Vec::new(), strings)
    }

    fn assemble(
        crate_version: *const c_char,
        error: *const c_char,
        bundles: Vec<BundleExport>,
        state_types: Vec<StateTypeExport>,
        strings: Vec<CString>,
    ) -> LibraryTable {
        LibraryTable {
            export: LibraryExport {
                header: LibraryHeader {
                    magic: LIBRARY_MAGIC,
                    abi_version: LIBRARY_ABI_VERSION,
                    struct_size: std::mem::size_of::<LibraryExport>() as u32,
                    crate_version,
                },
                error,
                xla_api_major: sys::XLA_FFI_API_MAJOR,
                xla_api_minor: sys::XLA_FFI_API_MINOR,
                bundles: bundles.as_ptr(),
                bundle_count: bundles.len(),
                state_types: state_types.as_ptr(),
                state_type_count: state_types.len(),
                attach_registry,
            },
            _bundles: bundles,
            _state_types: state_types,
            _strings: strings,
        }
    }

    /// The C table.
    pub fn as_ptr(&self) -> *const LibraryExport {
        &self.export
    }
}

/// The `attach_registry` entry of every table this copy of the crate makes.
unsafe extern "C" fn attach_registry(hooks: *const RegistryHooks) -> *const c_char {
    // SAFETY: the reader passes its host's table, which lives for the process.
    match unsafe { host::install(hooks) } {
        Ok(()) => ptr::null(),
        Err(host::HostError::Null) => c"the registry table is null".as_ptr(),
        Err(host::HostError::TooSmall { .. }) => {
            c"the registry table is smaller than this library's".as_ptr()
        }
        Err(host::HostError::OtherHost) => {
            c"this library already reports into another registry".as_ptr()
        }
    }
}

/// Exports every bundle of a `cdylib` as its library table (see [`LibraryTable`]), under the
/// C symbol `xla_ffi_bundles_library`, which `rmsnorm_ffi.register_library(path)` reads.
///
/// ```text
/// pub const COUNTER: BundleDef = BundleDef::of::<Counter>().instantiate().execute().build();
/// pub const RESET: BundleDef = BundleDef::of::<Reset>().execute().build();
/// xla_ffi_bundles::export_library!(COUNTER, RESET);
/// ```
///
/// It also defines `library_table()`, the same table as a Rust value. One per library: the
/// symbol is the library's entry point. `#[no_mangle]` is what makes the symbol findable by
/// name (and why the expansion is not plain safe Rust); it is left out of the crate's own test
/// builds, so that a test binary may include the sources of several libraries.
#[macro_export]
macro_rules! export_library {
    ($($def:expr),+ $(,)?) => {
        /// This library's table of bundles and state types, built on first use.
        pub fn library_table() -> &'static $crate::ffi::export::LibraryTable {
            static TABLE: ::std::sync::OnceLock<$crate::ffi::export::LibraryTable> =
                ::std::sync::OnceLock::new();
            TABLE.get_or_init(|| {
                $crate::ffi::export::LibraryTable::new(&[$($def),+])
                    .unwrap_or_else(|e| $crate::ffi::export::LibraryTable::failed(&e))
            })
        }

        /// The library's entry point: its table (see `xla_ffi_bundles::ffi::export`).
        #[cfg(not(test))]
        #[allow(unsafe_code)]
        #[no_mangle]
        pub extern "C" fn xla_ffi_bundles_library() -> *const $crate::ffi::export::LibraryExport {
            library_table().as_ptr()
        }
    };
}
