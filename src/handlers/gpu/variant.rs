//! Kernel variants: the tuning knob `RMSNORM_FFI_GPU_PLAN`, read when a call site is
//! instantiated. Never needed for correctness: an unset or empty value is the default plan, and
//! every variant computes the same function (the same bits wherever a row's reduction order is
//! the default's, else within the op contract's tolerance; `make gpu-emulate` runs each kind
//! through the emulated matrix). It exists so that one lent device window can time several
//! plans without a rebuild (bench/gpu_sweep.py), and so that a user can try a plan on their
//! own card. A plan the device has chosen belongs in `plan.rs`'s defaults, not in this knob.
//!
//! The value is `key=value` pairs separated by commas:
//! - `fwd_vpt=1|2|4|8`: vectors each thread of the forward (and the fused residual forward)
//!   caches (default 4; 8 halves the team per row, so more rows share a block);
//! - `fwd_block=B` (a power of two, 32..=1024): the forward's smallest block (default 256);
//! - `fwd_bounds=T` or `fwd_bounds=T:M`: the forward kernels' `__launch_bounds__`: at most T
//!   threads per block (a power of two, 32..=1024; default 1024) and at least M blocks per
//!   multiprocessor (T * M <= 2048, the threads a multiprocessor holds). Rows that would need a
//!   team of more than T threads take the streaming path;
//! - `persistent=N` (0..=32): the forward's grid is at most N blocks per multiprocessor, each
//!   looping over rows (0: one team per row, the default);
//! - `fwd_weight_early=0|1`: the cached forward loads a row's weight packs with its input,
//!   before the reduction (Quack's order: their loads in flight while the row's sum is formed),
//!   rather than after it (default 0; more registers: VPT weight packs per thread).
//!
//! Values equal to the default are dropped when parsed, so `fwd_vpt=4` is the default plan and
//! shares its compiled module. Knobs that change the machine code travel to NVRTC as `#define`
//! lines before the source ([`Variant::defines`]); modules are compiled and loaded once per
//! distinct set of them. The backward has no knobs yet: its kernels ignore the forward's
//! defines, so backward call sites always use the default module ([`Variant::for_backward`]).

use std::fmt;

/// The environment variable the bundles read at instantiate.
pub const ENV: &str = "RMSNORM_FFI_GPU_PLAN";

/// Defaults, as rmsnorm.cu and plan.rs have them without a variant.
pub const DEFAULT_FWD_VPT: u32 = 4;
pub const DEFAULT_FWD_BLOCK: u32 = 256;
pub const DEFAULT_FWD_MAX_THREADS: u32 = 1024;
/// Threads a multiprocessor holds (sm_80, sm_90): the bound on T * M.
pub const THREADS_PER_SM: u32 = 2048;

/// One plan override; `Variant::default()` is the default plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Variant {
    fwd_vpt: Option<u32>,
    fwd_block: Option<u32>,
    /// (T, M): max threads per block, min blocks per multiprocessor (None: unstated).
    fwd_bounds: Option<(u32, Option<u32>)>,
    persistent: Option<u32>,
    fwd_weight_early: Option<bool>,
}

const KEYS: &str = "fwd_vpt, fwd_block, fwd_bounds, persistent, fwd_weight_early";

fn power_of_two_in(key: &str, v: u32, lo: u32, hi: u32) -> Result<u32, String> {
    if v.is_power_of_two() && (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{key}={v}: expected a power of two from {lo} to {hi}"
        ))
    }
}

fn number(key: &str, text: &str) -> Result<u32, String> {
    text.trim()
        .parse::<u32>()
        .map_err(|_| format!("{key}={text}: expected a non-negative integer"))
}

impl Variant {
    /// Parses the knob's value (see the module doc). Errors name the key and what it takes.
    pub fn parse(text: &str) -> Result<Variant, String> {
        let mut v = Variant::default();
        let mut seen: Vec<&str> = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((key, value)) = item.split_once('=') else {
                return Err(format!("`{item}`: expected key=value (keys: {KEYS})"));
            };
            let key = key.trim();
            if seen.contains(&key) {
                return Err(format!("`{key}` given twice"));
            }
            seen.push(key);
            match key {
                "fwd_vpt" => {
                    let n = number(key, value)?;
                    v.fwd_vpt = Some(power_of_two_in(key, n, 1, 8)?);
                }
                "fwd_block" => {
                    let n = number(key, value)?;
                    v.fwd_block = Some(power_of_two_in(key, n, 32, 1024)?);
                }
                "fwd_bounds" => {
                    let (t, m) = match value.split_once(':') {
                        Some((t, m)) => (number(key, t)?, Some(number(key, m)?)),
                        None => (number(key, value)?, None),
                    };
                    let t = power_of_two_in(key, t, 32, 1024)?;
                    if let Some(m) = m {
                        if m == 0 || t * m > THREADS_PER_SM {
                            return Err(format!(
                                "fwd_bounds={value}: at least 1 block per multiprocessor, and \
                                 threads x blocks at most {THREADS_PER_SM}"
                            ));
                        }
                    }
                    v.fwd_bounds = Some((t, m));
                }
                "persistent" => {
                    let n = number(key, value)?;
                    if n > 32 {
                        return Err(format!(
                            "persistent={n}: at most 32 blocks per multiprocessor (0: off)"
                        ));
                    }
                    v.persistent = Some(n);
                }
                "fwd_weight_early" => {
                    v.fwd_weight_early = Some(match value.trim() {
                        "0" => false,
                        "1" => true,
                        _ => return Err(format!("fwd_weight_early={value}: expected 0 or 1")),
                    });
                }
                other => return Err(format!("unknown key `{other}` (keys: {KEYS})")),
            }
        }
        if let Some(b) = v.fwd_block.filter(|&b| b as usize > v.fwd_max_threads()) {
            return Err(format!(
                "fwd_block={b} is more than the {} threads fwd_bounds allows",
                v.fwd_max_threads()
            ));
        }
        Ok(v.canonical())
    }

    /// The variant `RMSNORM_FFI_GPU_PLAN` names now (unset or empty: the default).
    pub fn from_env() -> Result<Variant, String> {
        match std::env::var(ENV) {
            Ok(text) => Variant::parse(&text).map_err(|e| format!("{ENV}: {e}")),
            Err(std::env::VarError::NotPresent) => Ok(Variant::default()),
            Err(e) => Err(format!("{ENV}: {e}")),
        }
    }

    /// The same plan with every default value dropped.
    fn canonical(mut self) -> Variant {
        if self.fwd_vpt == Some(DEFAULT_FWD_VPT) {
            self.fwd_vpt = None;
        }
        if self.fwd_bounds == Some((DEFAULT_FWD_MAX_THREADS, None)) {
            self.fwd_bounds = None;
        }
        if self.fwd_block == Some(DEFAULT_FWD_BLOCK.min(self.fwd_max_threads() as u32)) {
            self.fwd_block = None;
        }
        if self.persistent == Some(0) {
            self.persistent = None;
        }
        if self.fwd_weight_early == Some(false) {
            self.fwd_weight_early = None;
        }
        self
    }

    pub fn is_default(&self) -> bool {
        *self == Variant::default()
    }

    /// Vectors a forward thread caches (rmsnorm.cu's FWD_VPT).
    pub fn fwd_vpt(&self) -> usize {
        self.fwd_vpt.unwrap_or(DEFAULT_FWD_VPT) as usize
    }

    /// Most threads per forward block (the kernels' launch bounds).
    pub fn fwd_max_threads(&self) -> usize {
        self.fwd_bounds.map_or(DEFAULT_FWD_MAX_THREADS, |b| b.0) as usize
    }

    /// The forward's smallest block: several teams of short rows share one this large.
    pub fn fwd_min_block(&self) -> usize {
        (self.fwd_block.unwrap_or(DEFAULT_FWD_BLOCK) as usize).min(self.fwd_max_threads())
    }

    /// Most forward blocks per multiprocessor in the grid (0: no cap).
    pub fn persistent(&self) -> usize {
        self.persistent.unwrap_or(0) as usize
    }

    /// The variant backward call sites use: the backward has no knobs yet, and its kernels are
    /// the same in every module, so it shares the default one.
    pub fn for_backward(&self) -> Variant {
        Variant::default()
    }

    /// `#define` lines NVRTC (and the emulator's host build) reads before rmsnorm.cu: empty for
    /// the default kernels, so their source is the file itself. Launch-only knobs (the block,
    /// the persistent grid) define nothing.
    pub fn defines(&self) -> String {
        let mut out = String::new();
        if let Some(vpt) = self.fwd_vpt {
            out += &format!("#define FWD_VPT {vpt}\n");
        }
        if let Some((t, m)) = self.fwd_bounds {
            out += &format!("#define FWD_MAX_THREADS {t}\n");
            if let Some(m) = m {
                out += &format!("#define FWD_MIN_BLOCKS {m}\n");
            }
        }
        if self.fwd_weight_early == Some(true) {
            out += "#define FWD_WEIGHT_EARLY 1\n";
        }
        out
    }
}

/// The canonical text: `default`, or the keys that differ from it in a fixed order.
impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(v) = self.fwd_vpt {
            parts.push(format!("fwd_vpt={v}"));
        }
        if let Some(b) = self.fwd_block {
            parts.push(format!("fwd_block={b}"));
        }
        match self.fwd_bounds {
            Some((t, Some(m))) => parts.push(format!("fwd_bounds={t}:{m}")),
            Some((t, None)) => parts.push(format!("fwd_bounds={t}")),
            None => {}
        }
        if let Some(p) = self.persistent {
            parts.push(format!("persistent={p}"));
        }
        if self.fwd_weight_early == Some(true) {
            parts.push("fwd_weight_early=1".to_string());
        }
        if parts.is_empty() {
            f.write_str("default")
        } else {
            f.write_str(&parts.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_canonicalizes_and_round_trips() {
        assert!(Variant::parse("").unwrap().is_default());
        assert!(Variant::parse(" , ").unwrap().is_default());
        // Values equal to the default are the default plan (and its module).
        let d = Variant::parse(
            "fwd_vpt=4, fwd_block=256,fwd_bounds=1024,persistent=0,fwd_weight_early=0",
        )
        .unwrap();
        assert!(d.is_default(), "{d}");
        assert_eq!(d.defines(), "");
        assert_eq!(d.to_string(), "default");
        let v = Variant::parse(
            "persistent=2, fwd_vpt=8 ,fwd_weight_early=1,fwd_bounds=256:4,fwd_block=128",
        )
        .unwrap();
        assert_eq!(
            v.to_string(),
            "fwd_vpt=8,fwd_block=128,fwd_bounds=256:4,persistent=2,fwd_weight_early=1"
        );
        assert_eq!(Variant::parse(&v.to_string()).unwrap(), v);
        assert_eq!(
            v.defines(),
            "#define FWD_VPT 8\n#define FWD_MAX_THREADS 256\n#define FWD_MIN_BLOCKS 4\n\
             #define FWD_WEIGHT_EARLY 1\n"
        );
        assert_eq!(
            (
                v.fwd_vpt(),
                v.fwd_max_threads(),
                v.fwd_min_block(),
                v.persistent()
            ),
            (8, 256, 128, 2)
        );
        // Bounds under the default block: the block is the bound (and no knob of its own).
        let v = Variant::parse("fwd_bounds=128:8").unwrap();
        assert_eq!((v.fwd_min_block(), v.fwd_max_threads()), (128, 128));
        assert_eq!(Variant::parse("fwd_bounds=128:8,fwd_block=128").unwrap(), v);
        // Launch-only knobs define nothing: the default module serves them.
        assert_eq!(
            Variant::parse("persistent=3,fwd_block=64")
                .unwrap()
                .defines(),
            ""
        );
        assert!(Variant::parse("fwd_vpt=8")
            .unwrap()
            .for_backward()
            .is_default());
    }

    #[test]
    fn errors_name_the_key_and_what_it_takes() {
        let err = |s: &str| Variant::parse(s).unwrap_err();
        assert!(err("fwd_vpt=3").contains("fwd_vpt=3: expected a power of two from 1 to 8"));
        assert!(err("fwd_vpt=16").contains("fwd_vpt=16"));
        assert!(err("fwd_block=2048").contains("fwd_block=2048"));
        assert!(err("fwd_block=x").contains("fwd_block=x: expected a non-negative integer"));
        assert!(err("fwd_bounds=1024:4").contains("at most 2048"));
        assert!(err("fwd_bounds=256:0").contains("at least 1 block"));
        assert!(err("fwd_bounds=100").contains("power of two"));
        assert!(err("persistent=33").contains("persistent=33"));
        assert!(err("fwd_block=512,fwd_bounds=256").contains("more than the 256 threads"));
        assert!(err("bwd_vpt=8").contains("unknown key `bwd_vpt`"));
        assert!(err("fwd_vpt").contains("expected key=value"));
        assert!(err("fwd_vpt=8,fwd_vpt=2").contains("given twice"));
        assert!(err("fwd_weight_early=yes").contains("expected 0 or 1"));
    }
}
