//! `levee-build [--source ROOT] [--target-dir DIR] OUT_DIR`: build the component and its core
//! module into OUT_DIR. By default from this workspace, compiling in `target/levee-wasm`;
//! `--source` builds another checkout (its `target/levee-wasm` unless `--target-dir`), which
//! the reproducibility check uses.

use std::path::PathBuf;

fn usage() -> ! {
    eprintln!("usage: levee-build [--source ROOT] [--target-dir DIR] [OUT_DIR]");
    std::process::exit(2)
}

fn main() {
    let (mut source, mut target_dir, mut out) = (None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--source" => source = Some(PathBuf::from(args.next().unwrap_or_else(|| usage()))),
            "--target-dir" => target_dir = Some(PathBuf::from(args.next().unwrap_or_else(|| usage()))),
            _ if out.is_none() && !a.starts_with('-') => out = Some(PathBuf::from(a)),
            _ => usage(),
        }
    }
    let out = out.unwrap_or_else(|| PathBuf::from("target/levee"));
    let root = source.unwrap_or_else(levee_build::workspace_root);
    let target_dir = target_dir.unwrap_or_else(|| root.join("target").join("levee-wasm"));
    match levee_build::build_from(&root, &target_dir, &out) {
        Ok(a) => {
            println!("{} ({} bytes, zero imports)", a.component.display(), a.component_bytes);
            println!("{}", a.core.display());
        }
        Err(e) => {
            eprintln!("levee-build: {e}");
            std::process::exit(1);
        }
    }
}
