/// `EMU_KERNEL(name, max_threads, min_blocks)` for every `extern "C"` entry point of the
/// preprocessed source, whose `__launch_bounds__` the shim left as `EMU_LAUNCH_BOUNDS(...)`.
pub fn kernel_table(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("EMU_LAUNCH_BOUNDS(") {
        rest = &rest[i + "EMU_LAUNCH_BOUNDS(".len()..];
        let close = rest.find(')').expect("closed launch bounds");
        let bounds: Vec<&str> = rest[..close].split(',').map(str::trim).collect();
        let after = rest[close + 1..].trim_start();
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        assert!(
            !name.is_empty(),
            "a kernel without a name after its launch bounds"
        );
        out.push(format!(
            "EMU_KERNEL({name}, {}, {})",
            bounds[0],
            bounds.get(1).copied().unwrap_or("0")
        ));
    }
    out
}
