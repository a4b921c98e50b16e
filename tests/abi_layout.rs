//! The hand-written C ABI mirror against the real header of every installed jaxlib.
//!
//! For each header (`xla/ffi/api/c_api.h` under `jax.ffi.include_dir()`), compiles a C program
//! that prints every mirrored struct's size, `*_STRUCT_SIZE`, every field's offset and size, and
//! every enum value, and compares each number with `xla_ffi_bundles::ffi::sys`:
//!
//! - the header of the API version the mirror was written for (0.3, jaxlib 0.10.2) must agree
//!   on everything: a jaxlib that moves, resizes or renames anything fails here instead of
//!   corrupting memory;
//! - a newer header (0.5, jaxlib 0.12) is checked for what the two share, which is what a 0.5
//!   runtime running our 0.3 handlers relies on: every field we mirror at the same offset with
//!   the same size (under the new name where the header renamed it, [`RENAMED_IN_0_5`]), every
//!   enum value the same, structs the runtime hands us no smaller (newer runtimes append), and
//!   structs we fill and hand to the runtime with the same `*_STRUCT_SIZE` (the runtime checks
//!   the size we declare against its own), except where the newer runtime is known to accept
//!   the older size ([`ACCEPTED_AT_THE_OLDER_SIZE`]).
//!
//! Headers: `$XLA_FFI_INCLUDE_DIRS` (`:`-separated; `make rust-test` passes those of `.venv/`
//! and `.venv-new/`), else `$XLA_FFI_INCLUDE_DIR`, else asked of the Pythons of `.venv/` and
//! `.venv-new/` that exist, else of `python3`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use xla_ffi_bundles::ffi::sys::{self, v0_5, StructLayout, PREFIX_FIELDS};

/// One version of the mirror: the API minor version it was written for, its structs and enum
/// values under that version's names, the headers it needs, and constants it copies.
struct Mirror {
    minor: i32,
    structs: &'static [StructLayout],
    enums: &'static [&'static [(&'static str, std::ffi::c_int)]],
    /// Enum types besides the 0.3 mirror's ([`ENUMS`], which every mirror has), whose size the
    /// test checks.
    enum_types: &'static [&'static str],
    includes: &'static [&'static str],
    constants: &'static [(&'static str, i64)],
}

/// `sys`: API 0.3, checked against every header (newer ones by the rules of the module doc).
const MIRROR_0_3: Mirror = Mirror {
    minor: 3,
    structs: sys::ALL_STRUCTS,
    enums: sys::ALL_ENUM_VALUES,
    enum_types: &[],
    includes: &["xla/ffi/api/c_api.h"],
    constants: &[],
};

/// `sys::v0_5`: API 0.5 and the collectives extension, checked exactly against a 0.5 header.
const MIRROR_0_5: Mirror = Mirror {
    minor: 5,
    structs: v0_5::ALL_STRUCTS,
    enums: v0_5::ALL_ENUM_VALUES,
    enum_types: &["XLA_FFI_CollectiveGroupMode"],
    includes: &["xla/ffi/api/c_api.h", "xla/ffi/api/collectives_c_api.h"],
    constants: v0_5::CONSTANTS,
};

/// Names the 0.5 header gives to what the 0.3 mirror names otherwise (same layout).
const RENAMED_IN_0_5: &[(&str, &str)] = &[
    ("XLA_FFI_Extension_Base", "XLA_FFI_InternalExtension"),
    ("XLA_FFI_Extension_Type", "XLA_FFI_InternalExtension_Type"),
    (
        "XLA_FFI_Error_GetMessage_Args",
        "XLA_FFI_Error_GetDetails_Args",
    ),
    ("XLA_FFI_Error_GetMessage", "XLA_FFI_Error_GetDetails"),
    (
        "XLA_FFI_ExecutionContext_Get_Args",
        "XLA_FFI_InvokeContext_Get_Args",
    ),
    ("XLA_FFI_ExecutionContext_Get", "XLA_FFI_InvokeContext_Get"),
];

/// Structs the crate fills and passes to the runtime's functions (or hands over, as the type
/// info): a runtime checks that the size they declare covers its own `*_STRUCT_SIZE`.
const HANDED_TO_THE_RUNTIME: &[&str] = &[
    "XLA_FFI_Api_Version",
    "XLA_FFI_TypeInfo",
    "XLA_FFI_Error_Create_Args",
    "XLA_FFI_Error_GetMessage_Args",
    "XLA_FFI_Error_Destroy_Args",
    "XLA_FFI_Type_Register_Args",
    "XLA_FFI_State_Set_Args",
    "XLA_FFI_State_Get_Args",
    "XLA_FFI_Stream_Get_Args",
    "XLA_FFI_DeviceMemory_Allocate_Args",
    "XLA_FFI_DeviceMemory_Free_Args",
    "XLA_FFI_ThreadPool_Schedule_Args",
    "XLA_FFI_ThreadPool_NumThreads_Args",
    "XLA_FFI_RunId_Get_Args",
    "XLA_FFI_DeviceOrdinal_Get_Args",
];

/// Structs the newer header grew that the newer runtime still takes at the older size, and why
/// we know. (The crate never calls the functions of the others that grew.)
const ACCEPTED_AT_THE_OLDER_SIZE: &[(&str, &str)] = &[(
    "XLA_FFI_Error_GetMessage_Args",
    "0.5 renamed it GetDetails and added `errc` after `message` (STRUCT_SIZE 36 instead of 32). \
     The crate hands 0.5 runtimes 0.5's args (sys::v0_5::XLA_FFI_Error_GetDetails_Args, checked \
     exactly by the 0.5 mirror) and 0.3's only to 0.3 runtimes; a 0.5 runtime given 0.3's would \
     still accept them (jaxlib 0.12's XLA_FFI_Error_GetDetails compares struct_size with 0x20 \
     before it stores errc, read from its machine code)",
)];

/// Structs the crate mirrors but never exchanges with a runtime. A newer header may lay them out
/// differently; the test reports that and does not fail.
const NEVER_EXCHANGED: &[(&str, &str)] = &[(
    "XLA_FFI_Handler_Register_Args",
    "JAX registers handlers itself (its own C++ fills this struct); the crate never calls \
     XLA_FFI_Handler_Register, and the fake runtime refuses it. 0.5 embeds a larger \
     XLA_FFI_Handler_Bundle (a `record` stage), which moves `traits`",
)];

/// Where the mirror and a header disagree, or what could not be checked.
type Mismatches = Vec<String>;

fn python_include_dir(python: &str) -> Option<PathBuf> {
    let out = Command::new(python)
        .args(["-c", "import jax.ffi; print(jax.ffi.include_dir())"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn include_dirs() -> Vec<PathBuf> {
    if let Ok(dirs) = std::env::var("XLA_FFI_INCLUDE_DIRS") {
        return std::env::split_paths(&dirs)
            .filter(|d| !d.as_os_str().is_empty())
            .collect();
    }
    if let Ok(dir) = std::env::var("XLA_FFI_INCLUDE_DIR") {
        return vec![PathBuf::from(dir)];
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let venvs: Vec<PathBuf> = [".venv", ".venv-new"]
        .iter()
        .map(|v| root.join(v).join("bin/python"))
        .filter(|p| p.exists())
        .collect();
    let found: Vec<PathBuf> = venvs
        .iter()
        .filter_map(|p| python_include_dir(&p.to_string_lossy()))
        .collect();
    if !found.is_empty() {
        return found;
    }
    python_include_dir("python3").into_iter().collect()
}

/// `name` as the header of API minor version `minor` spells it (the 0.5 mirror's names are
/// 0.5's already: none is in [`RENAMED_IN_0_5`]'s old column but the enums of [`ENUMS`]).
fn header_name(name: &str, minor: i32) -> &str {
    let name = name.strip_prefix("r#").unwrap_or(name);
    if minor >= 5 {
        if let Some((_, new)) = RENAMED_IN_0_5.iter().find(|(old, _)| *old == name) {
            return new;
        }
    }
    name
}

const ENUMS: [&str; 7] = [
    "XLA_FFI_Extension_Type",
    "XLA_FFI_Error_Code",
    "XLA_FFI_DataType",
    "XLA_FFI_ArgType",
    "XLA_FFI_RetType",
    "XLA_FFI_AttrType",
    "XLA_FFI_ExecutionStage",
];

/// One field the test compares: its name in the report, how the mirror names it in C (`None`
/// for a prefix, [`PREFIX_FIELDS`], which spans to the header's field `next`), and the mirror's
/// offset and size.
struct Checked {
    key: String,
    c_field: Option<&'static str>,
    next: Option<&'static str>,
    offset: usize,
    size: usize,
}

/// The fields of `s` the test compares: each field, and for a prefix the prefix itself and each
/// field of the struct it holds ([`v0_5::PREFIXES`]) where the header puts it.
fn checked_fields(s: &StructLayout) -> Vec<Checked> {
    let bare = |name: &'static str| name.strip_prefix("r#").unwrap_or(name);
    let mut out = Vec::new();
    for (i, f) in s.fields.iter().enumerate() {
        if !PREFIX_FIELDS.contains(&f.name) {
            out.push(Checked {
                key: bare(f.name).into(),
                c_field: Some(f.name),
                next: None,
                offset: f.offset,
                size: f.size,
            });
            continue;
        }
        let next = s.fields.get(i + 1).expect("a field after a prefix").name;
        out.push(Checked {
            key: f.name.into(),
            c_field: None,
            next: Some(next),
            offset: f.offset,
            size: f.size,
        });
        let (_, inner) = v0_5::PREFIXES
            .iter()
            .find(|(outer, _)| *outer == s.name)
            .unwrap_or_else(|| panic!("{}: no entry in v0_5::PREFIXES", s.name));
        for g in inner.fields {
            out.push(Checked {
                key: format!("{}.{}", f.name, bare(g.name)),
                c_field: Some(g.name),
                next: None,
                offset: f.offset + g.offset,
                size: g.size,
            });
        }
    }
    out
}

fn c_program(mirror: &Mirror, minor: i32) -> String {
    let n = |name: &str| header_name(name, minor).to_string();
    let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n");
    for include in mirror.includes {
        writeln!(c, "#include \"{include}\"").unwrap();
    }
    c.push_str("int main(void) {\n");
    for s in mirror.structs {
        let name = n(s.name);
        writeln!(c, "  printf(\"size {} %zu\\n\", sizeof({name}));", s.name).unwrap();
        if s.struct_size.is_some() {
            writeln!(
                c,
                "  printf(\"struct_size {} %zu\\n\", (size_t){name}_STRUCT_SIZE);",
                s.name
            )
            .unwrap();
        }
        for f in checked_fields(s) {
            let expression = match f.c_field {
                Some(field) => {
                    let field = n(field);
                    format!("offsetof({name}, {field}), sizeof((({name}*)0)->{field})")
                }
                // A prefix: from 0 to the header's next field.
                None => format!("(size_t)0, offsetof({name}, {})", n(f.next.unwrap())),
            };
            writeln!(
                c,
                "  printf(\"field {}.{} %zu %zu\\n\", {expression});",
                s.name, f.key
            )
            .unwrap();
        }
    }
    for values in mirror.enums {
        for (name, _) in *values {
            writeln!(c, "  printf(\"enum {name} %d\\n\", (int){name});").unwrap();
        }
    }
    for e in ENUMS.iter().chain(mirror.enum_types) {
        writeln!(c, "  printf(\"enum_size {e} %zu\\n\", sizeof({}));", n(e)).unwrap();
    }
    for (name, _) in mirror.constants {
        writeln!(c, "  printf(\"const {name} %lld\\n\", (long long){name});").unwrap();
    }
    for constant in [
        "XLA_FFI_API_MAJOR",
        "XLA_FFI_API_MINOR",
        "XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE",
    ] {
        writeln!(c, "  printf(\"const {constant} %d\\n\", (int){constant});").unwrap();
    }
    c.push_str("  return 0;\n}\n");
    c
}

fn compile_and_run(include: &Path, tag: &str, source: &str) -> Result<String, String> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("abi_layout_{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, binary) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&src, source).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(include)
        .arg(&src)
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let out = Command::new(&binary).output().unwrap();
    assert!(out.status.success());
    Ok(String::from_utf8(out.stdout).unwrap())
}

/// The header's `XLA_FFI_API_MINOR`, for choosing its names and the rules.
fn header_minor(include: &Path, tag: &str) -> i32 {
    let source = "#include <stdio.h>\n#include \"xla/ffi/api/c_api.h\"\nint main(void) { printf(\"%d %d\\n\", XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); return 0; }\n";
    let out = compile_and_run(include, &format!("{tag}_version"), source)
        .unwrap_or_else(|e| panic!("{}: {e}", include.display()));
    let (major, minor) = out.trim().split_once(' ').unwrap();
    assert_eq!(
        major,
        sys::XLA_FFI_API_MAJOR.to_string(),
        "another major version"
    );
    minor.parse().unwrap()
}

fn facts(output: &str) -> HashMap<String, String> {
    output
        .lines()
        .map(|line| {
            let (key, value) = line.rsplit_once(' ').unwrap();
            match key.rsplit_once(' ') {
                // "field S.f OFFSET SIZE": keep "field S.f" -> "OFFSET SIZE"
                Some((k, offset)) if k.starts_with("field ") => {
                    (k.to_string(), format!("{offset} {value}"))
                }
                _ => (key.to_string(), value.to_string()),
            }
        })
        .collect()
}

/// Checks the mirror against the header under `include`; returns its minor version, the
/// number of fields compared, the mismatches and the notes (differences in structs the crate
/// never exchanges with a runtime).
fn check(mirror: &Mirror, include: &Path, tag: &str) -> (i32, usize, Mismatches, Vec<String>) {
    assert!(
        include.join("xla/ffi/api/c_api.h").exists(),
        "no c_api.h under {}",
        include.display()
    );
    let minor = header_minor(include, tag);
    assert!(
        minor >= mirror.minor,
        "{}: API 0.{minor} is older than the mirror's 0.{}",
        include.display(),
        mirror.minor
    );
    let exact = minor == mirror.minor;
    let output = compile_and_run(include, tag, &c_program(mirror, minor)).unwrap_or_else(|e| {
        panic!(
            "the layout program does not compile against API 0.{minor} ({}): a mirrored name \
             is missing there (add it to RENAMED_IN_0_5 if it was renamed):\n{e}",
            include.display()
        )
    });
    let facts = facts(&output);
    let mut mismatches = Vec::new();
    let mut notes = Vec::new();
    let get = |key: &str| -> Option<usize> { facts.get(key).and_then(|v| v.parse().ok()) };
    let mut checked = 0;
    for s in mirror.structs {
        let found = check_struct(s, &facts, &get, minor, exact, &mut checked);
        match NEVER_EXCHANGED.iter().find(|(n, _)| *n == s.name) {
            Some((_, why)) if !exact && !found.is_empty() => notes.push(format!(
                "{} differs ({}); not used with a runtime: {why}",
                s.name,
                found.join("; ")
            )),
            _ => mismatches.extend(found),
        }
    }
    for (name, value) in mirror.constants {
        match facts.get(&format!("const {name}")) {
            Some(c) if *c == value.to_string() => {}
            other => mismatches.push(format!("const {name}: C says {other:?}, Rust says {value}")),
        }
    }
    for values in mirror.enums {
        for (name, value) in *values {
            match facts.get(&format!("enum {name}")) {
                Some(c) if *c == value.to_string() => {}
                other => {
                    mismatches.push(format!("enum {name}: C says {other:?}, Rust says {value}"))
                }
            }
        }
    }
    for e in ENUMS.iter().chain(mirror.enum_types) {
        if facts.get(&format!("enum_size {e}")).map(String::as_str) != Some("4") {
            mismatches.push(format!("enum_size {e}: not 4"));
        }
    }
    let constant = |name: &str| {
        facts
            .get(&format!("const {name}"))
            .cloned()
            .unwrap_or_default()
    };
    if constant("XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE")
        != sys::XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE.to_string()
    {
        mismatches.push("const XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE differs".into());
    }
    (minor, checked, mismatches, notes)
}

/// The mismatches of one struct (see the module doc for the rules of a newer header).
fn check_struct(
    s: &sys::StructLayout,
    facts: &HashMap<String, String>,
    get: &dyn Fn(&str) -> Option<usize>,
    minor: i32,
    exact: bool,
    checked: &mut usize,
) -> Mismatches {
    let mut mismatches = Vec::new();
    // Fields: the same offset and size in every header.
    for f in checked_fields(s) {
        let key = format!("field {}.{}", s.name, f.key);
        let rust = format!("{} {}", f.offset, f.size);
        match facts.get(&key) {
            Some(c) if *c == rust => *checked += 1,
            Some(c) => mismatches.push(format!("{key}: C says {c}, Rust says {rust}")),
            None => mismatches.push(format!("{key}: not printed by the C program")),
        }
    }
    let Some(c_size) = get(&format!("size {}", s.name)) else {
        mismatches.push(format!("size {}: not printed", s.name));
        return mismatches;
    };
    let c_struct_size = get(&format!("struct_size {}", s.name));
    if exact {
        if c_size != s.size {
            mismatches.push(format!(
                "size {}: C says {c_size}, Rust says {}",
                s.name, s.size
            ));
        }
        if c_struct_size != s.struct_size {
            mismatches.push(format!(
                "struct_size {}: C says {c_struct_size:?}, Rust says {:?}",
                s.name, s.struct_size
            ));
        }
        return mismatches;
    }
    if c_size < s.size {
        mismatches.push(format!(
            "size {}: C says {c_size}, smaller than Rust's {}",
            s.name, s.size
        ));
    }
    let handed = HANDED_TO_THE_RUNTIME.contains(&s.name);
    let accepted = ACCEPTED_AT_THE_OLDER_SIZE
        .iter()
        .any(|(name, _)| *name == s.name);
    match (c_struct_size, s.struct_size) {
        (Some(c), Some(rust)) if handed && c != rust && !accepted => mismatches.push(format!(
            "struct_size {}: API 0.{minor} says {c}, the mirror {rust}, and the crate hands this \
             struct to the runtime, which checks the size",
            s.name
        )),
        (Some(c), Some(rust)) if c < rust => mismatches.push(format!(
            "struct_size {}: API 0.{minor} says {c}, smaller than the mirror's {rust}",
            s.name
        )),
        (None, Some(_)) | (Some(_), None) => mismatches.push(format!(
            "struct_size {}: C says {c_struct_size:?}, Rust says {:?}",
            s.name, s.struct_size
        )),
        _ => {}
    }
    mismatches
}

#[test]
fn rust_mirror_matches_the_header_of_every_installed_jaxlib() {
    let dirs = include_dirs();
    assert!(
        !dirs.is_empty(),
        "cannot find the XLA FFI headers: set XLA_FFI_INCLUDE_DIRS or install jax into .venv \
         (`make test` does both)"
    );
    assert_eq!(sys::ALL_STRUCTS.len(), 34);
    assert_eq!(v0_5::ALL_STRUCTS.len(), 44);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut checked_0_5 = false;
    for (i, dir) in dirs.iter().enumerate() {
        for mirror in [&MIRROR_0_3, &MIRROR_0_5] {
            let tag = format!("{i}_{}", mirror.minor);
            if header_minor(dir, &tag) < mirror.minor {
                continue;
            }
            checked_0_5 |= mirror.minor == 5;
            let (minor, checked, mismatches, notes) = check(mirror, dir, &tag);
            assert!(
                checked > 150 || !mismatches.is_empty(),
                "only {checked} fields checked"
            );
            report.push(format!(
                "the 0.{} mirror against API 0.{minor} ({}): {checked} fields agree",
                mirror.minor,
                dir.display()
            ));
            report.extend(notes.into_iter().map(|n| format!("  note: {n}")));
            if !mismatches.is_empty() {
                failures.push(format!(
                    "the 0.{} mirror against API 0.{minor} ({}):\n  {}",
                    mirror.minor,
                    dir.display(),
                    mismatches.join("\n  ")
                ));
            }
        }
    }
    eprintln!("{}", report.join("\n"));
    // `make rust-test` passes .venv-new/'s headers (jax 0.12.0.1, API 0.5) where it exists, as
    // `make test` makes it: there the 0.5 mirror must have been checked.
    let venv_new = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-new/bin/python");
    assert!(
        checked_0_5 || !venv_new.exists(),
        "the 0.5 mirror was not checked: no API 0.5 header among {dirs:?}, though .venv-new \
         exists (set XLA_FFI_INCLUDE_DIRS as `make rust-test` does)"
    );
    if !checked_0_5 {
        eprintln!("the 0.5 mirror was not checked: no API 0.5 header among {dirs:?}");
    }
    assert!(
        failures.is_empty(),
        "ABI mismatches:\n{}",
        failures.join("\n")
    );
}

#[test]
fn every_rename_and_exception_names_a_mirrored_struct_or_field() {
    // A stale entry would silently stop checking something.
    let names: Vec<&str> = sys::ALL_STRUCTS
        .iter()
        .flat_map(|s| std::iter::once(s.name).chain(s.fields.iter().map(|f| f.name)))
        .chain(ENUMS)
        .collect();
    for (old, _) in RENAMED_IN_0_5 {
        assert!(names.contains(old), "{old}");
    }
    let listed = ACCEPTED_AT_THE_OLDER_SIZE.iter().chain(NEVER_EXCHANGED);
    for name in HANDED_TO_THE_RUNTIME.iter().chain(listed.map(|(n, _)| n)) {
        assert!(sys::ALL_STRUCTS.iter().any(|s| s.name == *name), "{name}");
    }
}
