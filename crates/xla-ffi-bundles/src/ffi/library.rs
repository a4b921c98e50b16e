//! Loading another library's table: `dlopen` a shared library built on this crate, find its
//! [`super::export::LIBRARY_SYMBOL`], check the table's header and contents, and attach the
//! library to this process's registry.
//!
//! Everything read from the table is checked before it is used: the header first (magic,
//! version: a library built against another version of this crate is refused with both
//! versions named), then every pointer, count, string, platform and index. What comes out is
//! owned, validated data ([`Library`]). Loaded libraries are never unloaded: XLA keeps their
//! handlers, and their states may outlive any Python object.

use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::path::{Path, PathBuf};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::export::{
    BundleExport, LibraryExport, LibraryHeader, LibraryTable, StateTypeExport, LIBRARY_ABI_VERSION,
    LIBRARY_MAGIC, LIBRARY_SYMBOL,
};
use super::host::RegistryHooks;
use super::platform;
use super::stage::Stage;
use super::sys;

/// Bundles or state types above this are a corrupt table, not a library.
const MAX_ENTRIES: usize = 1 << 16;

/// Why a library could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LibraryError {
    /// The file could not be found or loaded as a shared library.
    #[error("{path} cannot be loaded as a shared library: {message}")]
    Load {
        /// The library's path.
        path: String,
        /// The loader's message.
        message: String,
    },
    /// The library does not export [`LIBRARY_SYMBOL`].
    #[error(
        "{path} is not a bundle library: it exports no `{LIBRARY_SYMBOL}` (a library built on \
         xla-ffi-bundles exports it with xla_ffi_bundles::export_library!)"
    )]
    NotABundleLibrary {
        /// The library's path.
        path: String,
    },
    /// The symbol returned no table of this crate (null, misaligned or without the magic
    /// number).
    #[error("{path} is not a bundle library: its `{LIBRARY_SYMBOL}` {problem}")]
    NotATable {
        /// The library's path.
        path: String,
        /// What the symbol did, worded to follow its name.
        problem: String,
    },
    /// The table is of another ABI version: the library was built against another version of
    /// this crate.
    #[error(
        "{path} was built against xla-ffi-bundles {library_version} (library table version \
         {library_abi}), which this xla-ffi-bundles {ours} (table version {ours_abi}) cannot read: \
         rebuild the library against xla-ffi-bundles {ours}"
    )]
    Incompatible {
        /// The library's path.
        path: String,
        /// The version of xla-ffi-bundles the library was built with.
        library_version: String,
        /// The library's table ABI version.
        library_abi: u32,
        /// This crate's version.
        ours: &'static str,
        /// This crate's table ABI version.
        ours_abi: u32,
    },
    /// The table has this crate's version but bad contents, or carries the library's own
    /// export error.
    #[error("{path} has an invalid library table: {problem}")]
    Invalid {
        /// The library's path.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// The library refused to report into this process's registry.
    #[error("{path} cannot report into this process's registry: {problem}")]
    Attach {
        /// The library's path.
        path: String,
        /// The library's reason.
        problem: String,
    },
}

/// A stage handler, safe to hand to XLA.
#[derive(Debug, Clone, Copy)]
pub struct Handler(pub sys::XLA_FFI_Handler);

/// One bundle of a loaded table, checked.
#[derive(Debug, Clone)]
pub struct LibraryBundle {
    /// The custom-call target name.
    pub target: String,
    /// The platform JAX registers it for, one of the names this crate knows.
    pub platform: &'static str,
    /// The handler traits XLA is told of.
    pub traits: sys::XLA_FFI_Handler_Traits,
    /// The stages it has, in XLA's order.
    pub stages: Vec<(Stage, Handler)>,
    /// Index into [`Library::state_types`].
    pub state_type: Option<usize>,
}

/// One state type of a loaded table: what `jax.ffi.register_ffi_type` needs.
#[derive(Debug, Clone)]
pub struct LibraryStateType {
    /// The name in XLA's process-wide type registry.
    pub name: String,
    /// The library's id cell, which XLA fills in at type registration.
    pub type_id: *mut sys::XLA_FFI_TypeId,
    /// The library's type info, with the deleter.
    pub type_info: *const sys::XLA_FFI_TypeInfo,
}

/// A checked library table.
#[derive(Debug, Clone)]
pub struct Library {
    /// Where it came from (a path, or a description for an in-process table).
    pub origin: String,
    /// The xla-ffi-bundles version it was built with.
    pub crate_version: String,
    /// The oldest XLA FFI API version its handlers run on; they report the newest that both
    /// they and the runtime speak ([`super::metadata::reported_minor`]).
    pub xla_api_version: (i32, i32),
    /// The bundles, in table order.
    pub bundles: Vec<LibraryBundle>,
    /// The state types, which [`LibraryBundle::state_type`] indexes.
    pub state_types: Vec<LibraryStateType>,
}

// SAFETY: the raw pointers are to a loaded library's `'static` type infos and id cells (atomic
// cells that XLA writes once), which may be used from any thread; nothing here dereferences
// them.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

/// # Safety
/// `ptr` must be null or a NUL-terminated string valid for the call.
unsafe fn string(ptr: *const c_char, what: &str) -> Result<String, String> {
    if ptr.is_null() {
        return Err(format!("{what} is null"));
    }
    // SAFETY: per the contract.
    let s = unsafe { CStr::from_ptr(ptr) };
    s.to_str()
        .map(str::to_string)
        .map_err(|_| format!("{what} is not UTF-8"))
}

/// # Safety
/// `ptr` must be null or point to `count` readable `T`s that live for the process.
unsafe fn entries<'a, T>(ptr: *const T, count: usize, what: &str) -> Result<&'a [T], String> {
    if count > MAX_ENTRIES {
        return Err(format!("{count} {what} (at most {MAX_ENTRIES})"));
    }
    if count == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() || !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(format!("{count} {what} at an invalid address"));
    }
    // SAFETY: per the contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, count) })
}

/// Checks the table at `table` (read from `origin`) and returns its contents.
///
/// # Safety
/// `table` must be null or point to memory readable for a [`LibraryHeader`]; if the header
/// says it is a table of this crate's version, to a whole [`LibraryExport`] whose pointers are
/// what the table's documentation says, valid for the process.
pub unsafe fn read_table(
    table: *const LibraryExport,
    origin: &str,
) -> Result<Library, LibraryError> {
    let not_a_table = |problem: &str| LibraryError::NotATable {
        path: origin.into(),
        problem: problem.into(),
    };
    let invalid = |problem: String| LibraryError::Invalid {
        path: origin.into(),
        problem,
    };
    if table.is_null() || !(table as usize).is_multiple_of(std::mem::align_of::<LibraryExport>()) {
        return Err(not_a_table("returned no table"));
    }
    // SAFETY: the header is readable (contract), and its layout is the same in every version.
    let header: LibraryHeader = unsafe { table.cast::<LibraryHeader>().read() };
    if header.magic != LIBRARY_MAGIC {
        return Err(not_a_table(
            "returned a table without the xla-ffi-bundles magic number",
        ));
    }
    if header.abi_version != LIBRARY_ABI_VERSION
        || (header.struct_size as usize) < std::mem::size_of::<LibraryExport>()
    {
        return Err(LibraryError::Incompatible {
            path: origin.into(),
            // SAFETY: the header's version string is NUL-terminated (any version).
            library_version: unsafe { string(header.crate_version, "the version") }
                .unwrap_or_else(|e| format!("(unknown: {e})")),
            library_abi: header.abi_version,
            ours: env!("CARGO_PKG_VERSION"),
            ours_abi: LIBRARY_ABI_VERSION,
        });
    }
    // SAFETY: a table of this version is a whole `LibraryExport` (contract, checked size).
    let export = unsafe { &*table };
    if !export.error.is_null() {
        // SAFETY: a non-null error is a NUL-terminated string.
        let problem = unsafe { string(export.error, "the error") }.map_err(invalid)?;
        return Err(invalid(problem));
    }
    // SAFETY: as for the header.
    let crate_version = unsafe { string(header.crate_version, "the version") }.map_err(invalid)?;
    // SAFETY: the table's arrays hold the counts it announces, for the process.
    let raw_types = unsafe { entries(export.state_types, export.state_type_count, "state types") }
        .map_err(invalid)?;
    // SAFETY: as above.
    let raw_bundles =
        unsafe { entries(export.bundles, export.bundle_count, "bundles") }.map_err(invalid)?;
    let state_types = raw_types
        .iter()
        .enumerate()
        .map(|(i, t)| state_type(t, i))
        .collect::<Result<Vec<_>, String>>()
        .map_err(invalid)?;
    for (i, t) in state_types.iter().enumerate() {
        if state_types[..i].iter().any(|u| u.name == t.name) {
            return Err(invalid(format!("state type `{}` is listed twice", t.name)));
        }
    }
    let mut bundles: Vec<LibraryBundle> = Vec::with_capacity(raw_bundles.len());
    for (i, b) in raw_bundles.iter().enumerate() {
        let bundle = bundle(b, i, state_types.len()).map_err(invalid)?;
        if bundles
            .iter()
            .any(|o| o.target == bundle.target && o.platform == bundle.platform)
        {
            return Err(invalid(format!(
                "target `{}` is listed twice for platform `{}`",
                bundle.target, bundle.platform
            )));
        }
        bundles.push(bundle);
    }
    Ok(Library {
        origin: origin.into(),
        crate_version,
        xla_api_version: (export.xla_api_major, export.xla_api_minor),
        bundles,
        state_types,
    })
}

/// Reads a table this copy of the crate made, with the same checks as another library's.
pub fn read_own(table: &LibraryTable, origin: &str) -> Result<Library, LibraryError> {
    // SAFETY: `LibraryTable::new` lays out a whole table whose pointers it owns or that are
    // `'static`; the borrow of `table` keeps it alive for the call.
    unsafe { read_table(table.as_ptr(), origin) }
}

fn state_type(t: &StateTypeExport, index: usize) -> Result<LibraryStateType, String> {
    // SAFETY: entries of a checked table hold NUL-terminated names.
    let name = unsafe { string(t.name, &format!("the name of state type {index}")) }?;
    if t.type_id.is_null() || t.type_info.is_null() {
        return Err(format!(
            "state type `{name}` has no type id or no type info"
        ));
    }
    Ok(LibraryStateType {
        name,
        type_id: t.type_id,
        type_info: t.type_info,
    })
}

fn bundle(b: &BundleExport, index: usize, state_types: usize) -> Result<LibraryBundle, String> {
    // SAFETY: entries of a checked table hold NUL-terminated strings.
    let target = unsafe { string(b.target, &format!("the target of bundle {index}")) }?;
    // SAFETY: as above.
    let platform_name = unsafe { string(b.platform, &format!("the platform of `{target}`")) }?;
    let platform = platform::NAMES
        .into_iter()
        .find(|p| *p == platform_name)
        .ok_or_else(|| {
            format!(
                "bundle `{target}` names platform `{platform_name}`; known: {}",
                platform::NAMES.join(", ")
            )
        })?;
    let h = &b.handlers;
    let stages: Vec<(Stage, Handler)> = [
        (Stage::Instantiate, h.instantiate),
        (Stage::Prepare, h.prepare),
        (Stage::Initialize, h.initialize),
        (Stage::Execute, h.execute),
    ]
    .into_iter()
    .filter_map(|(stage, handler)| handler.map(|f| (stage, Handler(f))))
    .collect();
    if h.execute.is_none() {
        return Err(format!("bundle `{target}` has no execute stage"));
    }
    let state_type = match b.state_type {
        -1 => None,
        i if (0..state_types as i64).contains(&i) => Some(i as usize),
        i => {
            return Err(format!(
                "bundle `{target}` names state type {i} of {state_types}"
            ))
        }
    };
    if state_type.is_some() && h.instantiate.is_none() {
        return Err(format!(
            "bundle `{target}` has a state type but no instantiate stage to make it"
        ));
    }
    Ok(LibraryBundle {
        target,
        platform,
        traits: b.traits,
        stages,
        state_type,
    })
}

/// Libraries loaded so far, by canonical path. Never unloaded (see the module doc).
static LOADED: Lazy<Mutex<HashMap<PathBuf, (libloading::Library, &'static Library)>>> =
    Lazy::new(Default::default);

/// Loads the library at `path` (once per canonical path; later calls return the same table),
/// checks its table and attaches it to the registry behind `hooks`.
pub fn load(path: &Path, hooks: &'static RegistryHooks) -> Result<&'static Library, LibraryError> {
    let shown = path.display().to_string();
    let canonical = path.canonicalize().map_err(|e| LibraryError::Load {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let mut loaded = LOADED.lock();
    if let Some((_, library)) = loaded.get(&canonical) {
        return Ok(library);
    }
    let origin = canonical.display().to_string();
    // SAFETY: loading a library runs its initialisers; a library built on this crate has none
    // beyond Rust's, and the caller asked for this one by path.
    let handle =
        unsafe { libloading::Library::new(&canonical) }.map_err(|e| LibraryError::Load {
            path: origin.clone(),
            message: e.to_string(),
        })?;
    type Entry = unsafe extern "C" fn() -> *const LibraryExport;
    // SAFETY: the symbol, if present, is `export_library!`'s entry, of this type.
    let entry: Entry = match unsafe { handle.get::<Entry>(LIBRARY_SYMBOL.as_bytes()) } {
        Ok(symbol) => *symbol,
        Err(_) => return Err(LibraryError::NotABundleLibrary { path: origin }),
    };
    // SAFETY: the entry takes nothing and returns its table, which lives for the process.
    let table = unsafe { entry() };
    // SAFETY: a table returned by the entry has a readable header, and the rest is checked.
    let library = unsafe { read_table(table, &origin) }?;
    // SAFETY: a table of this version has `attach_registry`; `hooks` lives for the process.
    let problem = unsafe { ((*table).attach_registry)(hooks) };
    if !problem.is_null() {
        return Err(LibraryError::Attach {
            path: origin,
            // SAFETY: a non-null result is a NUL-terminated reason that lives for the process.
            problem: unsafe { string(problem, "the reason") }.unwrap_or_else(|e| e),
        });
    }
    let library: &'static Library = Box::leak(Box::new(library));
    loaded.insert(canonical, (handle, library));
    Ok(library)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::bundle::{Bundle, BundleDef, Execute, Instantiate, NoState};
    use crate::ffi::context::Context;
    use crate::ffi::error::FfiResult;
    use crate::ffi::export::ExportError;
    use crate::ffi::platform::{Cuda, Host};
    use crate::ffi::types::StateType;

    struct Tally;
    crate::state_type!(Tally, "library_tests.Tally");
    struct SameName;
    crate::state_type!(SameName, "library_tests.Tally");

    macro_rules! stateless {
        ($ty:ident, $target:literal, $platform:ty) => {
            struct $ty;
            impl Bundle for $ty {
                const TARGET: &'static str = $target;
                type Platform = $platform;
                type State = NoState;
            }
            impl Execute for $ty {
                type Args<'a> = ();
                type Rets<'a> = ();
                type Attrs<'a> = ();
                fn execute(_: &NoState, _: &Context<'_>, _: (), _: (), _: ()) -> FfiResult<()> {
                    Ok(())
                }
            }
        };
    }
    stateless!(Echo, "library_tests_echo", Host);
    stateless!(EchoOnGpu, "library_tests_echo", Cuda);

    struct Counting;
    impl Bundle for Counting {
        const TARGET: &'static str = "library_tests_counting";
        type Platform = Host;
        type State = Tally;
    }
    impl Instantiate for Counting {
        type Attrs<'a> = ();
        fn instantiate(_: &Context<'_>, _: ()) -> FfiResult<Tally> {
            Ok(Tally)
        }
    }
    impl Execute for Counting {
        type Args<'a> = ();
        type Rets<'a> = ();
        type Attrs<'a> = ();
        fn execute(_: &Tally, _: &Context<'_>, _: (), _: (), _: ()) -> FfiResult<()> {
            Ok(())
        }
    }
    struct Clash;
    impl Bundle for Clash {
        const TARGET: &'static str = "library_tests_clash";
        type Platform = Host;
        type State = SameName;
    }
    impl Instantiate for Clash {
        type Attrs<'a> = ();
        fn instantiate(_: &Context<'_>, _: ()) -> FfiResult<SameName> {
            Ok(SameName)
        }
    }
    impl Execute for Clash {
        type Args<'a> = ();
        type Rets<'a> = ();
        type Attrs<'a> = ();
        fn execute(_: &SameName, _: &Context<'_>, _: (), _: (), _: ()) -> FfiResult<()> {
            Ok(())
        }
    }

    const ECHO: BundleDef = BundleDef::of::<Echo>().execute().build();
    const ECHO_ON_GPU: BundleDef = BundleDef::of::<EchoOnGpu>().execute().build();
    const COUNTING: BundleDef = BundleDef::of::<Counting>().instantiate().execute().build();
    const CLASH: BundleDef = BundleDef::of::<Clash>().instantiate().execute().build();

    fn table() -> LibraryTable {
        LibraryTable::new(&[COUNTING, ECHO, ECHO_ON_GPU]).unwrap()
    }

    #[test]
    fn a_table_reads_back_as_declared() {
        let table = table();
        let library = read_own(&table, "test").unwrap();
        assert_eq!(library.crate_version, env!("CARGO_PKG_VERSION"));
        assert_eq!(library.xla_api_version, (0, 3));
        let summary: Vec<_> = library
            .bundles
            .iter()
            .map(|b| (b.target.as_str(), b.platform, b.stages.len(), b.state_type))
            .collect();
        assert_eq!(
            summary,
            [
                ("library_tests_counting", "cpu", 2, Some(0)),
                ("library_tests_echo", "cpu", 1, None),
                ("library_tests_echo", "cuda", 1, None),
            ]
        );
        assert_eq!(library.bundles[0].stages[0].0, Stage::Instantiate);
        let (name, id, info) = (
            &library.state_types[0].name,
            library.state_types[0].type_id,
            library.state_types[0].type_info,
        );
        assert_eq!(name, "library_tests.Tally");
        assert_eq!(id, Tally::registration().type_id_ptr());
        assert_eq!(info, Tally::registration().type_info_ptr());
    }

    #[test]
    fn inconsistent_declarations_are_refused_when_the_table_is_made() {
        let Err(e) = LibraryTable::new(&[ECHO, COUNTING, ECHO]) else {
            panic!("a target declared twice for one platform")
        };
        assert_eq!(
            e,
            ExportError::DuplicateTarget {
                target: "library_tests_echo".into(),
                platform: "cpu".into()
            }
        );
        let Err(e) = LibraryTable::new(&[COUNTING, CLASH]) else {
            panic!("two state types under one name")
        };
        assert_eq!(
            e.to_string(),
            "two different state types are both called `library_tests.Tally`"
        );
        // The library exports the reason instead of bundles, and the reader reports it.
        let failed = LibraryTable::failed(&e);
        let Err(LibraryError::Invalid { problem, .. }) = read_own(&failed, "lib.so") else {
            panic!("a failed table reads as invalid")
        };
        assert_eq!(problem, e.to_string());
    }

    /// Reads a copy of `table` after `edit`.
    fn read_edited(edit: impl FnOnce(&mut LibraryExport)) -> Result<Library, LibraryError> {
        let table = table();
        // SAFETY: `LibraryExport` is plain data; the copy points into `table`, alive here.
        let mut copy = unsafe { table.as_ptr().read() };
        edit(&mut copy);
        // SAFETY: the copy is a whole table whose pointers are `table`'s, or broken on purpose
        // in ways `read_table` must detect before following them.
        unsafe { read_table(&copy, "lib.so") }
    }

    #[test]
    fn the_header_is_checked_before_anything_else() {
        // SAFETY: a null table is refused without reading.
        let e = unsafe { read_table(std::ptr::null(), "lib.so") }.unwrap_err();
        assert_eq!(
            e.to_string(),
            "lib.so is not a bundle library: its `xla_ffi_bundles_library` returned no table"
        );
        let e = read_edited(|t| t.header.magic[0] = b'X').unwrap_err();
        assert!(matches!(e, LibraryError::NotATable { .. }), "{e}");
        let e = read_edited(|t| {
            t.header.abi_version += 1;
            t.bundles = std::ptr::null(); // never followed: the version is checked first
        })
        .unwrap_err();
        let ours = env!("CARGO_PKG_VERSION");
        let abi = LIBRARY_ABI_VERSION;
        assert_eq!(
            e.to_string(),
            format!(
                "lib.so was built against xla-ffi-bundles {ours} (library table version {}), which \
                 this xla-ffi-bundles {ours} (table version {abi}) cannot read: rebuild the library \
                 against xla-ffi-bundles {ours}",
                abi + 1
            )
        );
        let e = read_edited(|t| t.header.struct_size = 8).unwrap_err();
        assert!(matches!(e, LibraryError::Incompatible { .. }), "{e}");
    }

    #[test]
    fn broken_entries_are_refused_with_the_reason() {
        let problem = |edit: fn(&mut LibraryExport)| match read_edited(edit) {
            Err(LibraryError::Invalid { problem, .. }) => problem,
            other => panic!("{other:?}"),
        };
        assert!(
            problem(|t| t.bundles = std::ptr::null()).contains("3 bundles at an invalid address")
        );
        assert!(problem(|t| t.state_type_count = usize::MAX).contains("state types (at most"));
        assert!(
            problem(|t| t.header.crate_version = std::ptr::null()).contains("the version is null")
        );
        // Entries: copy the bundles to edit them.
        let table = table();
        // SAFETY: as in `read_edited`.
        let mut copy = unsafe { table.as_ptr().read() };
        // SAFETY: the table holds `bundle_count` bundles.
        let mut bundles =
            unsafe { std::slice::from_raw_parts(copy.bundles, copy.bundle_count) }.to_vec();
        let mut check = |edit: &dyn Fn(&mut BundleExport), expected: &str| {
            let mut edited = bundles.clone();
            edit(&mut edited[0]);
            copy.bundles = edited.as_ptr();
            // SAFETY: the copy's pointers are `table`'s and `edited`'s, both alive.
            let e = unsafe { read_table(&copy, "lib.so") }.unwrap_err();
            assert!(e.to_string().contains(expected), "{e}");
        };
        check(&|b| b.state_type = 5, "names state type 5 of 1");
        check(&|b| b.handlers.execute = None, "has no execute stage");
        check(
            &|b| b.handlers.instantiate = None,
            "no instantiate stage to make it",
        );
        check(
            &|b| b.platform = c"rocm".as_ptr(),
            "names platform `rocm`; known: cpu, cuda",
        );
        check(
            &|b| b.target = c"library_tests_echo".as_ptr(),
            "listed twice for platform `cpu`",
        );
        bundles.clear();
    }

    #[test]
    fn files_that_are_no_libraries_are_refused() {
        let hooks = &crate::state::registry::HOOKS;
        let e = load(Path::new("/no/such/library.so"), hooks).unwrap_err();
        assert!(matches!(e, LibraryError::Load { .. }), "{e}");
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let e = load(&manifest, hooks).unwrap_err();
        assert!(
            e.to_string()
                .contains("cannot be loaded as a shared library"),
            "{e}"
        );
    }
}
