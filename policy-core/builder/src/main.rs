//! `levee-build OUT_DIR`: build the component and its core module into OUT_DIR.

fn main() {
    let out = std::env::args().nth(1).unwrap_or_else(|| "target/levee".to_string());
    match levee_build::build(std::path::Path::new(&out)) {
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
