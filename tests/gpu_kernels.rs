//! Compiles every kernel (both norms) with NVRTC from pip (`nvidia-cuda-nvrtc-cu12`) for compute_80
//! and compute_90, through the crate's own library search, and assembles the PTX with `ptxas`
//! from `nvidia-cuda-nvcc-cu12` for sm_80 and sm_90. No GPU needed.
//!
//! `RMSNORM_FFI_SITE_PACKAGES` (set by `make rust-test`) names the site-packages holding the
//! `nvidia/*` packages; without it the test only says it skipped. With it, any failure fails.
//! Registers and spills per kernel print with `--nocapture`.

use std::path::{Path, PathBuf};
use std::process::Command;

use rmsnorm_ffi::handlers::gpu::driver::{Nvrtc, Search, LINEINFO_ENV};
use rmsnorm_ffi::handlers::gpu::kernels::{KERNELS, NAMES, SOURCE};

/// Spill bytes (stores, and loads) tolerated per kernel: the float32 backward keeps 32 cached
/// values of x, 32 of dy and 32 accumulators per thread under a 128-register cap, and spills a
/// little (32/52 bytes of stores/loads on sm_80, 32/56 on sm_90, NVRTC and ptxas 12.x from pip).
/// Anything beyond fails the test.
const SPILL_BUDGET: u64 = 128;

/// The same for the vector backward of a float64 weight next to float32 or half-precision x
/// (`rmsnorm_bwd_{f32,bf16,f16}_wf64_{v,c}`): its weight packs are two to four times x's bytes (a
/// 32-byte pack per 16 bytes of float32 x), read in the dot product and again for dx, under the
/// same cap. Measured: f32 40/132 bytes on sm_80, 32/96 on sm_90; f16 48/80 on both.
const WIDE_WEIGHT_SPILL_BUDGET: u64 = 192;

/// The budget for kernel `name`.
fn spill_budget(name: &str) -> u64 {
    let wide_weight = ["f32", "bf16", "f16"].iter().any(|x| {
        ["v", "c"]
            .iter()
            .any(|p| name == format!("rmsnorm_bwd_{x}_wf64_{p}"))
    });
    if wide_weight {
        WIDE_WEIGHT_SPILL_BUDGET
    } else {
        SPILL_BUDGET
    }
}

#[derive(Debug, Default)]
struct Usage {
    registers: u64,
    spill_stores: u64,
    spill_loads: u64,
}

fn parse_ptxas(out: &str) -> Vec<(String, Usage)> {
    let mut result: Vec<(String, Usage)> = Vec::new();
    for line in out.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            result.push((name, Usage::default()));
        } else if let Some((_, u)) = result.last_mut() {
            let num_before = |marker: &str| -> Option<u64> {
                let i = line.find(marker)?;
                line[..i].split_whitespace().last()?.parse().ok()
            };
            if let Some(v) = num_before(" bytes spill stores") {
                u.spill_stores = v;
            }
            if let Some(v) = num_before(" bytes spill loads") {
                u.spill_loads = v;
            }
            if let Some(i) = line.find("Used ") {
                if let Some(v) = line[i + 5..]
                    .split_whitespace()
                    .next()
                    .and_then(|s| s.parse().ok())
                {
                    u.registers = v;
                }
            }
        }
    }
    result
}

#[test]
fn every_kernel_compiles_and_assembles_for_sm80_and_sm90() {
    let Some(site) = std::env::var_os("RMSNORM_FFI_SITE_PACKAGES") else {
        eprintln!("SKIPPED: RMSNORM_FFI_SITE_PACKAGES is not set (make rust-test sets it)");
        return;
    };
    let site: Vec<PathBuf> = std::env::split_paths(&site).collect();
    // Only pip locations: the test proves the pip layout is found by the crate's search.
    let search = Search {
        site_packages: site.clone(),
        ..Search::default()
    };
    let nvrtc = Nvrtc::load(&search).unwrap_or_else(|e| panic!("{e}"));
    println!("NVRTC {:?} from {}", nvrtc.version(), nvrtc.path());
    let ptxas = pip_ptxas(&site);
    let dir = std::env::temp_dir().join(format!("rmsnorm_ffi_ptx_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Both norms' kernels in one compile (the bundles compile a module per norm), the two
    // architectures on two threads: NVRTC compiles on one core, and this test is most of the
    // file's time.
    let both = format!("#define KERNEL_NORMS 3\n{SOURCE}");
    let reports: Vec<(u32, String)> = std::thread::scope(|s| {
        let jobs: Vec<_> = [80u32, 90]
            .into_iter()
            .map(|cc| {
                let (nvrtc, ptxas, dir, both) = (&nvrtc, &ptxas, &dir, &both);
                s.spawn(move || {
                    let compiled = nvrtc
                        .compile(both, "rmsnorm.cu", &format!("compute_{cc}"))
                        .unwrap_or_else(|e| panic!("{e}"));
                    assert!(
                        compiled.log.trim().is_empty() || !compiled.log.contains("error"),
                        "{}",
                        compiled.log
                    );
                    for name in NAMES.iter() {
                        assert!(
                            compiled.ptx.contains(&format!(".entry {name}(")),
                            "{name} missing from the sm_{cc} PTX"
                        );
                    }
                    (cc, assemble(ptxas, &compiled.ptx, cc, dir, "rmsnorm"))
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let mut failures = Vec::new();
    for (cc, text) in reports {
        let usage = parse_ptxas(&text);
        assert_eq!(usage.len(), NAMES.len(), "ptxas output:\n{text}");
        println!(
            "sm_{cc}: {:<36} {:>4} {:>12}",
            "kernel", "regs", "spill st/ld"
        );
        for (name, u) in &usage {
            println!(
                "sm_{cc}: {name:<36} {:>4} {:>6}/{:<6}",
                u.registers, u.spill_stores, u.spill_loads
            );
            let budget = spill_budget(name);
            if u.spill_stores > budget || u.spill_loads > budget {
                failures.push(format!(
                    "sm_{cc} {name}: {} bytes spill stores, {} loads",
                    u.spill_stores, u.spill_loads
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "spills over budget: {failures:#?}");
}

/// ptxas from pip (`nvidia-cuda-nvcc-cu12`) under one of the site-packages directories.
fn pip_ptxas(site: &[PathBuf]) -> PathBuf {
    site.iter()
        .map(|s| s.join("nvidia/cuda_nvcc/bin/ptxas"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no nvidia/cuda_nvcc/bin/ptxas under {site:?}"))
}

/// Assembles `ptx` for sm_`cc` with `ptxas -v` (files `stem_cc.*` in `dir`): its report, after
/// checking it succeeded without errors.
fn assemble(ptxas: &Path, ptx: &str, cc: u32, dir: &Path, stem: &str) -> String {
    let ptx_path = dir.join(format!("{stem}_{cc}.ptx"));
    std::fs::write(&ptx_path, ptx).unwrap();
    let out = Command::new(ptxas)
        .arg("-v")
        .arg(format!("-arch=sm_{cc}"))
        .arg(&ptx_path)
        .arg("-o")
        .arg(dir.join(format!("{stem}_{cc}.cubin")))
        .output()
        .expect("ptxas runs");
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ptxas failed for sm_{cc}:\n{text}");
    assert!(
        !text.to_lowercase().contains("error"),
        "ptxas reported errors:\n{text}"
    );
    text
}

/// The forward kernels of the plan overrides bench/gpu_sweep.py times (their defines: launch-only
/// knobs compile nothing new), for the pairs that matter for speed, assembled for sm_90: each
/// compiles, stays within its launch bounds (ptxas caps the registers) and spills nothing.
/// Registers per kernel print with `--nocapture`, beside the default's: the static evidence the
/// GPU-speed issue asks for before a device times them.
#[test]
fn the_forward_variants_compile_and_assemble_without_spills() {
    use rmsnorm_ffi::handlers::gpu::variant::Variant;
    let Some(site) = std::env::var_os("RMSNORM_FFI_SITE_PACKAGES") else {
        eprintln!("SKIPPED: RMSNORM_FFI_SITE_PACKAGES is not set (make rust-test sets it)");
        return;
    };
    let site: Vec<PathBuf> = std::env::split_paths(&site).collect();
    let nvrtc = pip_nvrtc().unwrap();
    let ptxas = pip_ptxas(&site);
    let dir = std::env::temp_dir().join(format!("rmsnorm_ffi_variants_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The RMS norm's kernels: the defines change the forward code both norms share, and the
    // first compile of the other test has LayerNorm's under the default ones (NVRTC's time
    // per variant halves).
    let pairs = "#define KERNEL_NORMS 1\n#define EMU_PAIRS STAMP(bf16, bf16_t, bf16, bf16_t) \
                 STAMP(bf16, bf16_t, f32, float) STAMP(f32, float, f32, float)\n";
    let mut failures = Vec::new();
    // Tried and left out of the sweep: fwd_vpt=2 (ptxas gives the float32 and bfloat16 forward
    // 32 registers and 16/32 and 16/16 bytes of spills), fwd_vpt=8 under the default bounds of
    // 1024 threads (64 registers: the bfloat16 fused residual forward spills 4/12 bytes) or
    // bounds of 512 without a block count (ptxas still picks 64 registers: 12/40 bytes);
    // fwd_weight_early=1 under the default bounds (64 registers: 40/72 to 388/584 bytes of
    // spills) or with fwd_vpt=8 (bf16 x with an f32 weight: 128 registers, 112/244 bytes).
    for (i, text) in [
        "",
        "fwd_vpt=8,fwd_bounds=512:1",
        "fwd_weight_early=1,fwd_bounds=512:1",
        "fwd_block=128,fwd_bounds=128:8",
        "fwd_bounds=256:4",
    ]
    .iter()
    .enumerate()
    {
        let variant = Variant::parse(text).unwrap();
        let source = format!("{}{pairs}{SOURCE}", variant.defines());
        let compiled = nvrtc
            .compile(&source, "rmsnorm.cu", "compute_90")
            .unwrap_or_else(|e| panic!("{variant}: {e}"));
        let report = assemble(&ptxas, &compiled.ptx, 90, &dir, &format!("variant{i}"));
        let cap = 65536 / (variant.fwd_max_threads() as u64);
        for (name, u) in parse_ptxas(&report) {
            if !name.contains("fwd") || !name.ends_with("_v") {
                continue;
            }
            println!(
                "sm_90 {:<32} {name:<36} {:>4} regs {:>4}/{:<4} spill st/ld",
                variant.to_string(),
                u.registers,
                u.spill_stores,
                u.spill_loads
            );
            if u.spill_stores + u.spill_loads > 0 || u.registers > cap {
                failures.push(format!(
                    "{variant} {name}: {} registers (cap {cap}), spills {}/{}",
                    u.registers, u.spill_stores, u.spill_loads
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The `.param` types of PTX entry `name`, in order.
fn ptx_params(ptx: &str, name: &str) -> Vec<String> {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} missing from the PTX"));
    let body = &ptx[start..];
    let end = body.find(')').unwrap();
    body[..end]
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix(".param ")
                .map(|rest| rest.split_whitespace().next().unwrap_or("").to_string())
        })
        .collect()
}

fn pip_nvrtc() -> Option<Nvrtc> {
    let site = std::env::var_os("RMSNORM_FFI_SITE_PACKAGES")?;
    let search = Search {
        site_packages: std::env::split_paths(&site).collect(),
        ..Search::default()
    };
    Some(Nvrtc::load(&search).unwrap_or_else(|e| panic!("{e}")))
}

#[test]
fn the_kernel_parameter_table_matches_the_compiled_entry_points() {
    let Some(nvrtc) = pip_nvrtc() else {
        eprintln!("SKIPPED: RMSNORM_FFI_SITE_PACKAGES is not set (make rust-test sets it)");
        return;
    };
    // Both norms' families, for a few pairs (every kernel of a family comes from one entry
    // macro of rmsnorm.cu: the pairs change the element types, not the parameter list; the
    // whole table compiles in every_kernel_compiles_and_assembles_for_sm80_and_sm90).
    let source = format!(
        "#define KERNEL_NORMS 3\n#define EMU_PAIRS STAMP(bf16, bf16_t, bf16, bf16_t) \
         STAMP(f32, float, f64, double) STAMP(f64, double, f16, f16_t) \
         FINALIZE_ENTRY(f32, float, f64, double) FINALIZE_ENTRY(f64, double, f16, f16_t)\n{SOURCE}"
    );
    let compiled = nvrtc
        .compile(&source, "rmsnorm.cu", "compute_90")
        .unwrap_or_else(|e| panic!("{e}"));
    let stamped = [
        "_bf16_wbf16_",
        "_f32_wf64_",
        "_f64_wf16_",
        "_f32_wf64",
        "_f64_wf16",
    ];
    let mut checked = 0;
    for (name, signature) in KERNELS.iter() {
        if !stamped.iter().any(|p| name.contains(p)) {
            continue;
        }
        checked += 1;
        let want: Vec<&str> = signature.params.iter().map(|(_, p)| p.ptx_type()).collect();
        assert_eq!(
            ptx_params(&compiled.ptx, name),
            want,
            "{name}: the table in kernels.rs ({}) disagrees with rmsnorm.cu",
            signature.family
        );
    }
    // 3 pairs x 13 kernels, and the 2 finalizes.
    assert_eq!(checked, 3 * 13 + 2);
}

#[test]
fn the_lineinfo_knob_puts_source_lines_in_the_ptx() {
    let Some(nvrtc) = pip_nvrtc() else {
        eprintln!("SKIPPED: RMSNORM_FFI_SITE_PACKAGES is not set (make rust-test sets it)");
        return;
    };
    // This test binary compiles directly (not through the once-per-process cache), so setting
    // the variable here affects only the compile below. One pair's kernels (rmsnorm.cu's
    // EMU_PAIRS) show it as well as all 216, in a fraction of the time.
    let one_pair = format!(
        "#define EMU_PAIRS STAMP(f32, float, f32, float)\n{}",
        SOURCE
    );
    std::env::set_var(LINEINFO_ENV, "1");
    let with = nvrtc
        .compile(&one_pair, "rmsnorm.cu", "compute_90")
        .unwrap();
    std::env::remove_var(LINEINFO_ENV);
    let without = nvrtc
        .compile(&one_pair, "rmsnorm.cu", "compute_90")
        .unwrap();
    assert!(with.ptx.contains(".loc"), "-lineinfo gives .loc directives");
    assert!(!without.ptx.contains(".loc"), "no .loc without the knob");
}
