//! The paged export and import (`export-state-page`, `import-state-begin`/`-page`/`-end`):
//! the pages of an export are the bytes of `export-state`, cut anywhere, and the paged import
//! reads any cut of them as `import-state` reads the whole, with the same rules and errors.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use levee_core::{BreakerState, Engine, LoadError, OutcomeKind, STATE_PAGE_BYTES};

const DOC: &str =
    "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    \
                   rate-limit: { rate: 5, per: 1s, burst: 2 }\n    keys: { max: 1000000 }\n  q: { attempts: 2 }\n";

/// `n` keys of policy `p` whose names are `len` bytes long (at least 8), one breaker ("open") open.
fn engine(n: usize, len: usize) -> Engine {
    let mut e = Engine::load(DOC, 9).unwrap();
    for i in 0..n {
        let key = format!("{i:0>len$}");
        e.start(i as u64 + 1, 0, &key, 0, i as u64, 0, 0, 0);
        e.report(i as u64 + 1, i as u64, 1, OutcomeKind::Success, 0, "", 0, 0);
    }
    for c in 0..2 {
        e.start(10_000_000 + c, 0, "open", 0, n as u64 + c, 0, 0, 0);
        e.report(10_000_000 + c, n as u64 + c, 1, OutcomeKind::Timeout, 0, "", 0, 0);
        e.cancel(10_000_000 + c, n as u64 + c);
    }
    e
}

/// The pages of one export of `page` bytes, concatenated, and how many there were.
fn paged(e: &mut Engine, snapshot: bool, page: usize) -> (Vec<u8>, usize) {
    let (mut out, mut cursor, mut pages) = (Vec::new(), 0u64, 0);
    loop {
        let p = e.export_page_sized(cursor, snapshot, page);
        assert!(p.bytes.len() <= page, "a page of {} bytes over {page}", p.bytes.len());
        out.extend_from_slice(&p.bytes);
        pages += 1;
        if p.next == 0 {
            return (out, pages);
        }
        assert_eq!(p.next, out.len() as u64, "the next cursor is the offset reached");
        cursor = p.next;
    }
}

fn import_paged(e: &mut Engine, bytes: &[u8], page: usize) -> Result<(), LoadError> {
    e.import_state_begin();
    for chunk in bytes.chunks(page.max(1)) {
        e.import_state_page(chunk)?;
    }
    e.import_state_end()
}

/// Pages of 1 byte, of a few, of less than a key's entry and of more than the document, of an
/// empty table, of keys longer than a page: always the bytes of the whole export.
#[test]
fn the_pages_are_the_whole_export_cut_anywhere() {
    for (n, len) in [(0, 8), (3, 8), (40, 300), (5, 1024)] {
        let mut e = engine(n, len);
        let whole = e.export_state();
        let snap = e.export_snapshot();
        for page in [1, 2, 7, 64, 100, 333, 1000, 4096, 1 << 20] {
            let (bytes, pages) = paged(&mut e, false, page);
            assert_eq!(bytes, whole, "{n} keys of {len} bytes, pages of {page}");
            assert_eq!(pages, whole.len().div_ceil(page), "every page but the last is full");
            assert_eq!(paged(&mut e, true, page).0, snap, "the snapshot, pages of {page}");
        }
    }
}

/// An empty key table: the policies' lists are empty, in one page or many.
#[test]
fn an_empty_table_pages() {
    let mut e = Engine::load(DOC, 3).unwrap();
    let whole = e.export_state();
    assert!(String::from_utf8_lossy(&whole).contains("\"keys\":[]"));
    assert_eq!(paged(&mut e, false, 5).0, whole);
    let mut fresh = Engine::load(DOC, 4).unwrap();
    import_paged(&mut fresh, &whole, 3).unwrap();
    assert_eq!(fresh.export_state(), whole);
}

/// A cursor the engine did not give last (another export in between, or a host's retry)
/// starts the document again and skips to it.
#[test]
fn any_cursor_gives_the_bytes_at_that_offset() {
    let mut e = engine(30, 50);
    let whole = e.export_state();
    let first = e.export_page_sized(0, false, 100);
    let _other = e.export_page_sized(0, true, 10); // an export of the snapshot in between
    let second = e.export_page_sized(first.next, false, 100);
    assert_eq!(second.bytes, whole[100..200]);
    for at in [0u64, 1, 99, 1234, whole.len() as u64 - 1] {
        let p = e.export_page_sized(at, false, 64);
        let end = (at as usize + 64).min(whole.len());
        assert_eq!(p.bytes, whole[at as usize..end], "cursor {at}");
        assert_eq!(p.next, if end == whole.len() { 0 } else { end as u64 });
    }
    let past = e.export_page_sized(whole.len() as u64 + 10, false, 64);
    assert!(past.bytes.is_empty() && past.next == 0);
}

/// The paged import reads every cut of the export as `import-state` reads the whole: the same
/// state after, the breaker still open.
#[test]
fn the_paged_import_reads_any_cut() {
    let e = engine(60, 200);
    let whole = e.export_state();
    let mut once = Engine::load(DOC, 1).unwrap();
    once.import_state(&whole).unwrap();
    let expected = once.export_state();
    for page in [1, 3, 17, 64, 250, 1000, 1 << 20] {
        let mut fresh = Engine::load(DOC, 1).unwrap();
        import_paged(&mut fresh, &whole, page).unwrap();
        assert_eq!(fresh.export_state(), expected, "pages of {page}");
        assert_eq!(fresh.breaker_state(0, "open", 100), Some(BreakerState::Open));
    }
    // White space and members in another order (a document written by hand) read the same.
    let text = String::from_utf8(whole.clone()).unwrap();
    let spaced = text.replace(",\"", " ,\n \"").replace(":[", ": [ ");
    let mut fresh = Engine::load(DOC, 1).unwrap();
    import_paged(&mut fresh, spaced.as_bytes(), 11).unwrap();
    assert_eq!(fresh.export_state(), expected);
    let v: serde_json::Value = serde_json::from_slice(&whole).unwrap();
    let mut reordered = serde_json::Map::new();
    for k in ["policies", "tick", "rng", "version", "format"] {
        reordered.insert(k.to_string(), v[k].clone());
    }
    let mut fresh = Engine::load(DOC, 1).unwrap();
    import_paged(&mut fresh, serde_json::to_string(&reordered).unwrap().as_bytes(), 13).unwrap();
    assert_eq!(fresh.export_state(), expected);
}

/// The errors name the same field path as `import-state`'s, and an import that fails, is
/// left unfinished or is given a document that stops early changes nothing.
#[test]
fn a_failed_or_unfinished_import_changes_nothing() {
    let mut e = engine(20, 10);
    let before = e.export_state();
    let text = String::from_utf8(before.clone()).unwrap();
    let bad = text.replacen("\"last_used\":", "\"last_used\":\"x\",\"was\":", 5);
    let cases: Vec<(Vec<u8>, Option<&str>)> = vec![
        (bad.into_bytes(), None),
        (text.replace("levee-state", "other").into_bytes(), Some("format")),
        (text.replace("\"version\":1", "\"version\":9").into_bytes(), Some("version")),
        (b"[1,2]".to_vec(), Some("")),
        (b"{\"format\":\"levee-state\",\"version\":1,\"rng\":[1,2,3,4],\"tick\":0}".to_vec(), Some("policies")),
        (text.replace("\"name\":\"q\",", "").into_bytes(), Some("policies[1]")),
        (vec![0xff, 0xfe], Some("")),
    ];
    for (doc, field) in cases {
        let one = Engine::load(DOC, 1).unwrap().import_state(&doc).unwrap_err();
        for page in [1, 7, 1 << 20] {
            let err = import_paged(&mut e, &doc, page).unwrap_err();
            assert_eq!(err.path, one.path, "pages of {page}: {err:?} vs {one:?}");
            if let Some(f) = field {
                assert_eq!(err.path, f);
            }
            assert_eq!(e.export_state(), before, "nothing changed");
        }
    }
    // A document that stops early (anywhere: in a key's entry, a string, a number), and an
    // import never ended.
    for cut in [1, 2, 10, 57, 300, before.len() / 2, before.len() - 1] {
        let err = import_paged(&mut e, &before[..cut], 100).unwrap_err();
        assert!(err.message.contains("ends early"), "cut at {cut}: {err:?}");
        assert_eq!(e.export_state(), before);
    }
    e.import_state_begin();
    e.import_state_page(&Engine::load(DOC, 1).unwrap().export_state()).unwrap();
    assert_eq!(e.export_state(), before, "an import not ended changes nothing");
    assert!(e.import_state_end().is_ok());
    assert_eq!(e.key_count(0), 0);
    assert!(e.import_state_page(b"{").is_err(), "no import in progress");
    assert!(e.import_state_end().is_err());
}

/// A key's bad entry is named with its path by both imports.
#[test]
fn an_entry_error_names_its_path() {
    let e = engine(5, 8);
    let text = String::from_utf8(e.export_state()).unwrap();
    // The third key's entry (keys[2]) has a negative time.
    let at = text.match_indices("\"last_used\":").nth(2).unwrap().0 + "\"last_used\":".len();
    let bad = format!("{}-{}", &text[..at], &text[at..]);
    let one = Engine::load(DOC, 1).unwrap().import_state(bad.as_bytes()).unwrap_err();
    let mut fresh = Engine::load(DOC, 1).unwrap();
    let paged = import_paged(&mut fresh, bad.as_bytes(), 9).unwrap_err();
    assert_eq!(one, paged);
    assert!(one.path.starts_with("policies[0].keys[2]"), "{one:?}");
}

/// A page is bounded whatever the state's size: 200,000 keys of 64 bytes (about 40 MB) go out
/// and back in pages of at most `STATE_PAGE_BYTES`.
#[test]
fn a_large_state_goes_out_and_in_by_pages() {
    let mut e = engine(200_000, 64);
    let mut fresh = Engine::load(DOC, 1).unwrap();
    fresh.import_state_begin();
    let (mut cursor, mut total, mut pages) = (0u64, 0usize, 0);
    loop {
        let p = e.export_state_page(cursor, false);
        assert!(p.bytes.len() <= STATE_PAGE_BYTES);
        total += p.bytes.len();
        pages += 1;
        fresh.import_state_page(&p.bytes).unwrap();
        if p.next == 0 {
            break;
        }
        cursor = p.next;
    }
    fresh.import_state_end().unwrap();
    assert!(total > levee_core::state::MAX_STATE_BYTES / 2 && pages > 30, "{total} bytes in {pages} pages");
    assert_eq!(fresh.key_count(0), 200_001);
    assert_eq!(fresh.breaker_state(0, "open", 300_000), Some(BreakerState::Open));
}
