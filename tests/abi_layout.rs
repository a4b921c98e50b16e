//! The hand-written C ABI mirror against the real header.
//!
//! Compiles a C program against `xla/ffi/api/c_api.h` from the installed jaxlib
//! (`jax.ffi.include_dir()`), prints every struct's size, `*_STRUCT_SIZE`, every field's offset
//! and size, and every enum value, and compares each number with `rmsnorm_ffi::ffi::sys`. A
//! jaxlib that moves, resizes or renames anything fails here instead of corrupting memory.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use rmsnorm_ffi::ffi::sys::{ALL_ENUM_VALUES, ALL_STRUCTS};

/// The directory holding `xla/ffi/api/c_api.h`: `$XLA_FFI_INCLUDE_DIR`, else asked of the
/// project's `.venv` Python, else of `python3`.
fn include_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("XLA_FFI_INCLUDE_DIR") {
        return PathBuf::from(dir);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let pythons = [venv.to_string_lossy().into_owned(), "python3".to_string()];
    for python in &pythons {
        let out = Command::new(python)
            .args(["-c", "import jax.ffi; print(jax.ffi.include_dir())"])
            .output();
        if let Ok(out) = out {
            if out.status.success() {
                return PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            }
        }
    }
    panic!(
        "cannot find the XLA FFI headers: set XLA_FFI_INCLUDE_DIR or install jax into .venv \
         (`make test` does both)"
    );
}

fn c_field(name: &str) -> &str {
    name.strip_prefix("r#").unwrap_or(name)
}

fn c_program() -> String {
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"xla/ffi/api/c_api.h\"\nint main(void) {\n",
    );
    for s in ALL_STRUCTS {
        let n = s.name;
        writeln!(c, "  printf(\"size {n} %zu\\n\", sizeof({n}));").unwrap();
        if s.struct_size.is_some() {
            writeln!(
                c,
                "  printf(\"struct_size {n} %zu\\n\", (size_t){n}_STRUCT_SIZE);"
            )
            .unwrap();
        }
        for f in s.fields {
            let field = c_field(f.name);
            writeln!(
                c,
                "  printf(\"field {n}.{field} %zu %zu\\n\", offsetof({n}, {field}), sizeof((({n}*)0)->{field}));"
            )
            .unwrap();
        }
    }
    for values in ALL_ENUM_VALUES {
        for (name, _) in *values {
            writeln!(c, "  printf(\"enum {name} %d\\n\", (int){name});").unwrap();
        }
    }
    for e in [
        "XLA_FFI_Extension_Type",
        "XLA_FFI_Error_Code",
        "XLA_FFI_DataType",
        "XLA_FFI_ArgType",
        "XLA_FFI_RetType",
        "XLA_FFI_AttrType",
        "XLA_FFI_ExecutionStage",
    ] {
        writeln!(c, "  printf(\"enum_size {e} %zu\\n\", sizeof({e}));").unwrap();
    }
    writeln!(
        c,
        "  printf(\"const XLA_FFI_API_MAJOR %d\\n\", XLA_FFI_API_MAJOR);"
    )
    .unwrap();
    writeln!(
        c,
        "  printf(\"const XLA_FFI_API_MINOR %d\\n\", XLA_FFI_API_MINOR);"
    )
    .unwrap();
    writeln!(
        c,
        "  printf(\"const XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE %d\\n\", (int)XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);"
    )
    .unwrap();
    c.push_str("  return 0;\n}\n");
    c
}

fn c_facts() -> HashMap<String, String> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("abi_layout");
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("layout.c");
    let binary = dir.join("layout");
    std::fs::write(&source, c_program()).unwrap();
    let include = include_dir();
    assert!(
        include.join("xla/ffi/api/c_api.h").exists(),
        "no c_api.h under {}",
        include.display()
    );
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .arg("-std=c11")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-I")
        .arg(&include)
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(
        status.success(),
        "the layout program did not compile against {}",
        include.display()
    );
    let out = Command::new(&binary).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            let (key, value) = line.rsplit_once(' ').unwrap();
            let (key, value) = match key.rsplit_once(' ') {
                // "field S.f OFFSET SIZE": keep "field S.f" -> "OFFSET SIZE"
                Some((k, offset)) if k.starts_with("field ") => {
                    (k.to_string(), format!("{offset} {value}"))
                }
                _ => (key.to_string(), value.to_string()),
            };
            (key, value)
        })
        .collect()
}

#[test]
fn rust_mirror_matches_the_c_header() {
    let facts = c_facts();
    let mut mismatches = Vec::new();
    let mut check = |key: String, rust: String| match facts.get(&key) {
        Some(c) if *c == rust => {}
        Some(c) => mismatches.push(format!("{key}: C says {c}, Rust says {rust}")),
        None => mismatches.push(format!("{key}: not printed by the C program")),
    };
    let mut checked = 0;
    for s in ALL_STRUCTS {
        check(format!("size {}", s.name), s.size.to_string());
        if let Some(struct_size) = s.struct_size {
            check(format!("struct_size {}", s.name), struct_size.to_string());
        }
        for f in s.fields {
            check(
                format!("field {}.{}", s.name, c_field(f.name)),
                format!("{} {}", f.offset, f.size),
            );
            checked += 1;
        }
    }
    for values in ALL_ENUM_VALUES {
        for (name, value) in *values {
            check(format!("enum {name}"), value.to_string());
        }
    }
    for e in [
        "XLA_FFI_Extension_Type",
        "XLA_FFI_Error_Code",
        "XLA_FFI_DataType",
        "XLA_FFI_ArgType",
        "XLA_FFI_RetType",
        "XLA_FFI_AttrType",
        "XLA_FFI_ExecutionStage",
    ] {
        check(format!("enum_size {e}"), "4".into());
    }
    use rmsnorm_ffi::ffi::sys;
    check(
        "const XLA_FFI_API_MAJOR".into(),
        sys::XLA_FFI_API_MAJOR.to_string(),
    );
    check(
        "const XLA_FFI_API_MINOR".into(),
        sys::XLA_FFI_API_MINOR.to_string(),
    );
    check(
        "const XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE".into(),
        sys::XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE.to_string(),
    );
    assert!(
        mismatches.is_empty(),
        "ABI mismatches:\n{}",
        mismatches.join("\n")
    );
    assert_eq!(ALL_STRUCTS.len(), 34);
    assert!(checked > 150, "only {checked} fields checked");
}
