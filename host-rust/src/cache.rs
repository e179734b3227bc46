//! The on-disk cache of the compiled policy component (wasmtime's `Component::serialize` and
//! `Component::deserialize`), the Rust twin of the Python host's `_cache.py`.
//!
//! Compiling the component takes about half a second; reading it back compiled takes well
//! under a millisecond. Each entry is named after the SHA-256 of the component, of wasmtime's
//! major version and of the engine's compatibility hash
//! (`Engine::precompile_compatibility_hash`, fed to SHA-256, a hasher that never changes; it
//! covers the target, the compiler's flags, the engine's settings and wasmtime's full crate
//! version), so a new component, a new wasmtime or another configuration never reads an old
//! entry. An entry is
//!
//! ```text
//! MAGIC | its name's 32 bytes | SHA-256 of the payload (32 bytes) | payload (Component::serialize)
//! ```
//!
//! and is handed to wasmtime only when its name and its digest both check, so a truncated, damaged
//! or foreign file (another component's entry copied over) is compiled again and rewritten;
//! wasmtime itself then refuses an artifact from another version or configuration. Writes are
//! atomic (a temporary file in the same directory, renamed over the entry), so a reader sees
//! the old entry or the new one, never half of one. A read-only or full disk costs a compile and
//! nothing else.
//!
//! `LEVEE_CACHE_DIR` moves the cache (default: `$XDG_CACHE_HOME/levee` or `~/.cache/levee`;
//! `%LOCALAPPDATA%\levee` on Windows), as in the Python and Go hosts; `LEVEE_CACHE_DIR=off`
//! disables it. This host's entries are in its `wasmtime-rs/` subdirectory.
//!
//! A miss (a compile) removes the files of that directory last written more than
//! [`CACHE_PRUNE_AFTER_SECS`] ago (docs/hosts.md, "The compiled-component cache"): the entries of
//! components and wasmtimes no longer used, which are never read again, and a writer's leftover
//! temporary file.

use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

use crate::constants::CACHE_PRUNE_AFTER_SECS;

/// The environment variable that moves the cache (`off` disables it).
pub(crate) const CACHE_DIR_ENV: &str = "LEVEE_CACHE_DIR";

/// The first bytes of every entry: the format (bump it when the layout changes).
const MAGIC: &[u8] = b"levee-cwasm-rs-1\n";
/// The bytes in front of the payload: the magic, the entry's name, the payload's digest.
const HEAD: usize = MAGIC.len() + 32 + 32;
/// This host's subdirectory of the cache directory (shared with the other hosts).
const SUBDIR: &str = "wasmtime-rs";

/// Where the component came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// A sound entry of the cache.
    Cached,
    /// Compiled; `stored` says whether the entry was (re)written.
    Compiled { stored: bool },
}

/// The cache directory (this host's subdirectory), or `None` when the cache is off.
pub(crate) fn cache_dir() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    dir_from(
        var(CACHE_DIR_ENV),
        if cfg!(windows) { var("LOCALAPPDATA") } else { None },
        var("XDG_CACHE_HOME"),
        var(if cfg!(windows) { "USERPROFILE" } else { "HOME" }),
    )
}

/// [`cache_dir`] from the variables it reads (empty ones already dropped).
fn dir_from(
    configured: Option<OsString>,
    local_app_data: Option<OsString>,
    xdg: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    let base = match configured {
        Some(c) if c == "off" => return None,
        Some(c) => PathBuf::from(c),
        None => match (local_app_data, xdg, home) {
            (Some(l), _, _) => PathBuf::from(l).join("levee"),
            (None, Some(x), _) => PathBuf::from(x).join("levee"),
            (None, None, Some(h)) => PathBuf::from(h).join(".cache").join("levee"),
            (None, None, None) => return None,
        },
    };
    Some(base.join(SUBDIR))
}

/// SHA-256 as a [`std::hash::Hasher`], to hash wasmtime's compatibility hash with a hasher
/// that is the same in every build (std's `DefaultHasher` may change between Rust releases).
struct ShaHasher(Sha256);

impl std::hash::Hasher for ShaHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(&self) -> u64 {
        let d = self.0.clone().finalize();
        d.iter().take(8).fold(0, |h, b| (h << 8) | u64::from(*b))
    }
}

/// The entry's name for `wasm` compiled by `engine`: SHA-256 over the component's digest,
/// wasmtime's major version and the engine's compatibility hash.
fn key(engine: &Engine, wasm: &[u8]) -> [u8; 32] {
    use std::hash::Hash;
    let mut h = ShaHasher(Sha256::new());
    h.0.update(Sha256::digest(wasm));
    h.0.update(b"\0wasmtime ");
    h.0.update(wasmtime::ModuleVersionStrategy::WasmtimeVersion.as_str().as_bytes());
    h.0.update(b"\0");
    engine.precompile_compatibility_hash().hash(&mut h);
    h.0.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The path of `key`'s entry in `dir`.
fn entry_path(dir: &Path, key: &[u8; 32]) -> PathBuf {
    dir.join(format!("{}.cwasm", hex(key)))
}

/// The compiled component for `wasm`: from the cache in [`cache_dir`] when a sound entry is
/// there, else compiled (and the entry written).
pub(crate) fn load(engine: &Engine, wasm: &[u8]) -> wasmtime::Result<(Component, Source)> {
    load_in(cache_dir().as_deref(), engine, wasm)
}

/// [`load`] with the cache in `dir` (`None`: no cache).
pub(crate) fn load_in(dir: Option<&Path>, engine: &Engine, wasm: &[u8]) -> wasmtime::Result<(Component, Source)> {
    let Some(dir) = dir else {
        return Ok((Component::new(engine, wasm)?, Source::Compiled { stored: false }));
    };
    let key = key(engine, wasm);
    let path = entry_path(dir, &key);
    if let Some(component) = fs::read(&path).ok().and_then(|data| read_entry(engine, &key, &data)) {
        return Ok((component, Source::Cached));
    }
    let component = Component::new(engine, wasm)?;
    let stored = component.serialize().is_ok_and(|payload| store(dir, &path, &key, &payload).is_ok());
    prune(dir, &path, std::time::SystemTime::now());
    Ok((component, Source::Compiled { stored }))
}

/// Remove the files of `dir` last written more than [`CACHE_PRUNE_AFTER_SECS`] before `now`,
/// `keep` aside. Best effort: what cannot be listed, read or removed stays.
fn prune(dir: &Path, keep: &Path, now: std::time::SystemTime) {
    let Some(cutoff) = now.checked_sub(std::time::Duration::from_secs(u64::from(CACHE_PRUNE_AFTER_SECS))) else { return };
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let old = entry.metadata().is_ok_and(|m| m.is_file() && m.modified().is_ok_and(|t| t < cutoff));
        if old && path != keep {
            let _ = fs::remove_file(&path); // gone already, or not ours to remove
        }
    }
}

/// The component in `data`, an entry's bytes, if they are a sound entry named `key` that
/// wasmtime accepts.
fn read_entry(engine: &Engine, key: &[u8; 32], data: &[u8]) -> Option<Component> {
    if data.len() <= HEAD {
        return None;
    }
    let rest = data.strip_prefix(MAGIC)?;
    let (name, rest) = rest.split_first_chunk::<32>()?;
    let (digest, payload) = rest.split_first_chunk::<32>()?;
    if name != key || Sha256::digest(payload).as_slice() != digest.as_slice() {
        return None;
    }
    // Another wasmtime's or another configuration's artifact (wasmtime checks its header): compile again.
    deserialize(engine, payload).ok()
}

/// The one `unsafe` of this crate: wasmtime's `Component::deserialize`.
#[allow(unsafe_code)]
fn deserialize(engine: &Engine, payload: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `Component::deserialize` maps `payload` as machine code and trusts its metadata, so
    // it must be the output of `Component::serialize` of a compatible wasmtime. It is:
    // - these bytes are in memory (read once, not mapped from the file, so nothing can change
    //   them between the checks and the mapping), from an entry in the user's own cache
    //   directory (made 0700 when this library makes it) that this library wrote from
    //   `serialize`;
    // - the entry is named after the component, wasmtime's version and the engine's
    //   compatibility hash, and carries that name and the SHA-256 of these bytes, both checked
    //   by `read_entry`: a truncated, damaged or foreign file never gets here;
    // - wasmtime checks the artifact's own header (its version and the engine configuration it
    //   was compiled for) before using it, and refuses a mismatch with an error.
    // What this does not defend against: someone who can write the user's cache directory
    // can write a well-formed entry with a matching digest of code of their choosing; but who
    // can write there can equally replace this library or the program itself.
    unsafe { Component::deserialize(engine, payload) }
}

/// Write the entry for `payload` at `path` atomically: a temporary file in `dir`, renamed
/// over the entry. On any failure nothing is left behind.
fn store(dir: &Path, path: &Path, key: &[u8; 32], payload: &[u8]) -> std::io::Result<()> {
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)?;
    let unique = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(".tmp-{}-{unique}", std::process::id()));
    let written = (|| {
        let mut f = fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(key)?;
        f.write_all(&Sha256::digest(payload))?;
        f.write_all(payload)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

    use super::*;
    use crate::raw::wasm::{engine_config, COMPONENT};

    /// A directory of its own under the system's temporary directory, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            let unique = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            let p = std::env::temp_dir().join(format!("levee-cache-test-{name}-{}-{unique}", std::process::id()));
            fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn engine() -> Engine {
        Engine::new(&engine_config()).unwrap()
    }

    /// The one entry (and no temporary file) in `dir`.
    fn only_entry(dir: &Path) -> PathBuf {
        let names: Vec<PathBuf> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert!(names[0].extension().is_some_and(|e| e == "cwasm"), "{names:?}");
        names[0].clone()
    }

    /// The component works: it instantiates and a `load` answers.
    fn works(engine: &Engine, c: &Component) {
        let linker = wasmtime::component::Linker::<()>::new(engine);
        let mut store = wasmtime::Store::new(engine, ());
        store.set_epoch_deadline(u64::MAX / 2);
        let levee = crate::raw::wasm::Levee::instantiate(&mut store, c, &linker).unwrap();
        let loaded = levee.levee_policy_engine_api().engine().call_load(&mut store, "policies:\n  p:\n    attempts: 2\n", 1).unwrap();
        assert!(loaded.is_ok());
    }

    #[test]
    fn a_warm_cache_is_read_and_a_damaged_entry_is_compiled_again_and_rewritten() {
        let dir = TempDir::new("damaged");
        let engine = engine();
        let (c, how) = load_in(Some(&dir.0), &engine, COMPONENT).unwrap();
        assert_eq!(how, Source::Compiled { stored: true });
        works(&engine, &c);
        let entry = only_entry(&dir.0);
        let good = fs::read(&entry).unwrap();
        let (c, how) = load_in(Some(&dir.0), &engine, COMPONENT).unwrap();
        assert_eq!(how, Source::Cached);
        works(&engine, &c);

        let mut flipped = good.clone();
        flipped[HEAD + (good.len() - HEAD) / 2] ^= 0x10;
        let mut digest_broken = good.clone();
        digest_broken[MAGIC.len() + 32] ^= 1;
        let mut magic_broken = good.clone();
        magic_broken[0] ^= 1;
        let damaged: [(&str, Vec<u8>); 8] = [
            ("truncated in the payload", good[..good.len() / 2].to_vec()),
            ("truncated in the header", good[..HEAD - 5].to_vec()),
            ("only the header", good[..HEAD].to_vec()),
            ("empty", Vec::new()),
            ("a bit flipped in the payload", flipped),
            ("a broken digest", digest_broken),
            ("a broken magic", magic_broken),
            ("garbage", (0..good.len()).map(|i| (i * 7 + 3) as u8).collect()),
        ];
        for (what, bytes) in damaged {
            fs::write(&entry, &bytes).unwrap();
            let (c, how) = load_in(Some(&dir.0), &engine, COMPONENT).unwrap();
            assert_eq!(how, Source::Compiled { stored: true }, "{what}");
            works(&engine, &c);
            assert_eq!(only_entry(&dir.0), entry, "{what}");
            assert_eq!(fs::read(&entry).unwrap(), good, "{what}: the entry is rewritten");
            assert_eq!(load_in(Some(&dir.0), &engine, COMPONENT).unwrap().1, Source::Cached, "{what}");
        }
    }

    #[test]
    fn an_entry_for_another_component_or_configuration_is_compiled_again_and_rewritten() {
        let dir = TempDir::new("foreign");
        let engine = engine();
        // Another component: the same one with a custom section at its end.
        let mut other = COMPONENT.to_vec();
        other.extend_from_slice(&[0, 6, 5, b'o', b't', b'h', b'e', b'r']);
        assert_eq!(load_in(Some(&dir.0), &engine, &other).unwrap().1, Source::Compiled { stored: true });
        let foreign = only_entry(&dir.0);
        let ours = entry_path(&dir.0, &key(&engine, COMPONENT));
        assert_ne!(foreign, ours);
        fs::rename(&foreign, &ours).unwrap();
        let (c, how) = load_in(Some(&dir.0), &engine, COMPONENT).unwrap();
        assert_eq!(how, Source::Compiled { stored: true }, "another component's entry under our name is refused");
        works(&engine, &c);
        let good = fs::read(&ours).unwrap();
        assert_eq!(&good[MAGIC.len()..MAGIC.len() + 32], key(&engine, COMPONENT).as_slice());

        // A stale entry: ours, but compiled for another configuration (the name and digest
        // check; wasmtime refuses the artifact's header).
        let mut config = engine_config();
        config.epoch_interruption(false);
        let stale_engine = Engine::new(&config).unwrap();
        assert_ne!(key(&stale_engine, COMPONENT), key(&engine, COMPONENT), "the configuration is in the name");
        let payload = Component::new(&stale_engine, COMPONENT).unwrap().serialize().unwrap();
        let mut stale = MAGIC.to_vec();
        stale.extend_from_slice(&key(&engine, COMPONENT));
        stale.extend_from_slice(&Sha256::digest(&payload));
        stale.extend_from_slice(&payload);
        fs::write(&ours, &stale).unwrap();
        let (c, how) = load_in(Some(&dir.0), &engine, COMPONENT).unwrap();
        assert_eq!(how, Source::Compiled { stored: true });
        works(&engine, &c);
        assert_eq!(fs::read(&ours).unwrap(), good);
    }

    #[test]
    fn a_miss_prunes_the_files_not_written_for_the_prune_age() {
        use std::time::{Duration, SystemTime};
        let dir = TempDir::new("prune");
        let now = SystemTime::now();
        let age = Duration::from_secs(u64::from(CACHE_PRUNE_AFTER_SECS));
        let aged = |name: &str, by: SystemTime| {
            let f = fs::File::create(dir.0.join(name)).unwrap();
            f.set_modified(by).unwrap();
        };
        let (old, young) = (now - age - Duration::from_secs(60), now - age + Duration::from_secs(60));
        aged("old.cwasm", old);
        aged(".tmp-1-2", old);
        aged("recent.cwasm", young);
        fs::create_dir(dir.0.join("old-dir")).unwrap(); // not a file: never removed
        let names = || {
            let mut v: Vec<String> = fs::read_dir(&dir.0).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
            v.sort();
            v
        };

        let engine = engine();
        let (c, how) = load_in(Some(&dir.0), &engine, COMPONENT).unwrap(); // a miss: compile, write, prune
        assert_eq!(how, Source::Compiled { stored: true });
        works(&engine, &c);
        let left = names();
        let ours: Vec<&String> = left.iter().filter(|n| !["recent.cwasm", "old-dir"].contains(&n.as_str())).collect();
        assert_eq!(ours.len(), 1, "{left:?}");
        assert!(ours[0].ends_with(".cwasm") && ours[0] != "old.cwasm", "{left:?}");
        let entry = dir.0.join(ours[0]);

        // A hit prunes nothing: a file made old stays until the next miss.
        aged("old.cwasm", old);
        assert_eq!(load_in(Some(&dir.0), &engine, COMPONENT).unwrap().1, Source::Cached);
        assert!(dir.0.join("old.cwasm").exists());

        // The entry just written is kept whatever its age (a clock far ahead, say).
        prune(&dir.0, &entry, now + 10 * age);
        assert_eq!(names(), {
            let mut v = vec![ours[0].clone(), "old-dir".to_string()];
            v.sort();
            v
        });
    }

    #[test]
    fn an_unwritable_cache_costs_a_compile_and_nothing_else() {
        let dir = TempDir::new("unwritable");
        let file = dir.0.join("a-file");
        fs::write(&file, b"not a directory").unwrap();
        let engine = engine();
        for _ in 0..2 {
            let (c, how) = load_in(Some(&file.join("levee")), &engine, COMPONENT).unwrap();
            assert_eq!(how, Source::Compiled { stored: false });
            works(&engine, &c);
        }
        assert_eq!(fs::read(&file).unwrap(), b"not a directory");
        let (_, how) = load_in(None, &engine, COMPONENT).unwrap();
        assert_eq!(how, Source::Compiled { stored: false });
    }

    #[test]
    fn the_directory_follows_the_python_and_go_hosts() {
        let s = |v: &str| Some(OsString::from(v));
        assert_eq!(dir_from(s("off"), None, s("/x"), s("/h")), None);
        assert_eq!(dir_from(s("/c"), None, s("/x"), s("/h")), Some(PathBuf::from("/c/wasmtime-rs")));
        assert_eq!(dir_from(None, None, s("/x"), s("/h")), Some(PathBuf::from("/x/levee/wasmtime-rs")));
        assert_eq!(dir_from(None, None, None, s("/h")), Some(PathBuf::from("/h/.cache/levee/wasmtime-rs")));
        assert_eq!(dir_from(None, s("C:/l"), s("/x"), s("/h")), Some(PathBuf::from("C:/l/levee/wasmtime-rs")));
        assert_eq!(dir_from(None, None, None, None), None);
    }

    /// Run by [`levee_cache_dir_moves_the_cache_and_off_disables_it`] in a child process with
    /// the environment it sets (`--ignored`; it does nothing of interest on its own).
    #[test]
    #[ignore = "run by levee_cache_dir_moves_the_cache_and_off_disables_it in a child process"]
    fn child_loads_an_engine() {
        let engine = crate::RawEngine::load_with(crate::Backend::Wasm, "policies:\n  p:\n    attempts: 2\n", 1, crate::Limits::default());
        assert!(engine.is_ok());
    }

    /// `LEVEE_CACHE_DIR` through the real environment, in child processes (the variable is read
    /// once per process): a directory gets the entry, `off` writes nothing anywhere, unset
    /// writes under `$XDG_CACHE_HOME/levee/wasmtime-rs`.
    #[test]
    fn levee_cache_dir_moves_the_cache_and_off_disables_it() {
        let root = TempDir::new("env");
        let (xdg, moved) = (root.0.join("xdg"), root.0.join("moved"));
        let run = |cache: Option<&Path>| {
            let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
            cmd.args(["--exact", "cache::tests::child_loads_an_engine", "--ignored", "--test-threads", "1"]);
            cmd.env("XDG_CACHE_HOME", &xdg).env("HOME", root.0.join("home"));
            match cache {
                Some(p) => cmd.env(CACHE_DIR_ENV, p),
                None => cmd.env_remove(CACHE_DIR_ENV),
            };
            let out = cmd.output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
            assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "{}", String::from_utf8_lossy(&out.stdout));
        };
        run(Some(Path::new("off")));
        assert_eq!(fs::read_dir(&root.0).unwrap().count(), 0, "off writes nothing");
        run(Some(&moved));
        only_entry(&moved.join(SUBDIR));
        assert!(!xdg.exists());
        run(None);
        only_entry(&xdg.join("levee").join(SUBDIR));
    }
}
