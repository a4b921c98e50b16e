//! Builds the CPU emulator of the CUDA kernels (test-only):
//! - lists the kernels of rmsnorm.cu with their launch bounds, from the preprocessed source;
//! - `libemu_kernels.so`: rmsnorm.cu as host C++ (cpp/cuda_shim.h force-included) with the
//!   kernel table and the block scheduler (cpp/fibers.cpp);
//! - `libcuda_fake.so`: the fake driver (cpp/fake_cuda.cpp), which loads the kernels library;
//! - `build_info.rs`: the compiler command, so that tests can build the kernels library again
//!   from another source (planted bugs).
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let cpp = manifest.join("cpp");
    let source = manifest.join("../../src/handlers/gpu/rmsnorm.cu");
    let source = source.canonicalize().expect("rmsnorm.cu exists");
    println!(
        "cargo:rerun-if-changed={}",
        manifest.join("src/kernel_table.rs").display()
    );
    for f in [
        "cuda_shim.h",
        "emulator.h",
        "fibers.cpp",
        "kernels.cpp",
        "fake_cuda.cpp",
    ] {
        println!("cargo:rerun-if-changed={}", cpp.join(f).display());
    }
    println!("cargo:rerun-if-changed={}", source.display());

    let base = || {
        let mut b = cc::Build::new();
        b.cpp(true)
            .std("c++17")
            .opt_level(2)
            .pic(true)
            .warnings(false)
            .flag("-fno-strict-aliasing")
            .flag("-Wno-unknown-pragmas")
            .include(&cpp);
        b
    };
    let shim = cpp.join("cuda_shim.h");

    // 1. The kernel table.
    let expanded = base()
        .define("EMU_EXPAND", None)
        .flag("-include")
        .flag(shim.to_str().unwrap())
        .flag("-x")
        .flag("c++")
        .file(&source)
        .expand();
    let table = kernel_table(&String::from_utf8_lossy(&expanded));
    assert!(
        !table.is_empty(),
        "no kernels found in {}",
        source.display()
    );
    let table_path = out.join("kernel_table.inc");
    std::fs::write(&table_path, table.join("\n") + "\n").unwrap();

    // 2. Objects.
    let fibers = base().file(cpp.join("fibers.cpp")).compile_intermediates();
    let kernel_defines = |b: &mut cc::Build, src: &Path| {
        b.flag("-include")
            .flag(shim.to_str().unwrap())
            .define(
                "EMU_KERNEL_SOURCE",
                Some(format!("\"{}\"", src.display()).as_str()),
            )
            .define(
                "EMU_KERNEL_TABLE",
                Some(format!("\"{}\"", table_path.display()).as_str()),
            );
    };
    let mut kb = base();
    kernel_defines(&mut kb, &source);
    let kernels = kb.file(cpp.join("kernels.cpp")).compile_intermediates();
    let fake = base()
        .file(cpp.join("fake_cuda.cpp"))
        .compile_intermediates();

    // 3. Shared libraries.
    let compiler = base().get_compiler();
    let link = |objects: &[PathBuf], name: &str, libs: &[&str]| {
        let mut cmd = compiler.to_command();
        cmd.arg("-shared")
            .arg("-o")
            .arg(out.join(name))
            .args(objects)
            .args(libs);
        run(cmd);
    };
    link(
        &[kernels.clone(), fibers.clone()].concat(),
        "libemu_kernels.so",
        &[],
    );
    link(&fake, "libcuda_fake.so", &["-ldl"]);

    // 4. What a test needs to build the kernels library from another source.
    let mut kb = base();
    kernel_defines(&mut kb, Path::new("EMU_SOURCE_PLACEHOLDER"));
    let mut compile = kb.file(cpp.join("kernels.cpp")).get_compiler().to_command();
    compile.arg("-c");
    let program = format!("{:?}", compile.get_program().to_string_lossy());
    let args: Vec<String> = compile
        .get_args()
        .map(|a| format!("{:?}", a.to_string_lossy()))
        .collect();
    let info = format!(
        "/// The C++ compiler and its arguments for kernels.cpp (the source path is \
         EMU_SOURCE_PLACEHOLDER).\npub const COMPILER: &str = {program};\npub const COMPILE_ARGS: &[&str] = &[{}];\n\
         /// kernels.cpp and the objects of the block scheduler.\npub const KERNELS_CPP: &str = {:?};\n\
         pub const FIBER_OBJECTS: &[&str] = &[{}];\npub const OUT_DIR: &str = {:?};\n",
        args.join(", "),
        cpp.join("kernels.cpp").display().to_string(),
        fibers
            .iter()
            .map(|p| format!("{:?}", p.display().to_string()))
            .collect::<Vec<_>>()
            .join(", "),
        out.display().to_string(),
    );
    std::fs::write(out.join("build_info.rs"), info).unwrap();
}

// kernel_table(): shared with the library, which builds kernels from edited sources too.
include!("src/kernel_table.rs");

fn run(mut cmd: Command) {
    let status = cmd.status().expect("the C++ compiler runs");
    assert!(status.success(), "failed: {cmd:?}");
}
