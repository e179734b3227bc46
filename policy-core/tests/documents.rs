//! Any text from YAML's own characters gives a tree or an error with a line and column, never
//! a panic (the parser under src/doc.rs is a library; this drives its corners from outside).
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use levee_core::doc;
use proptest::prelude::*;

/// YAML's indicators, whitespace, escapes and a few letters and digits.
const ALPHABET: &[&str] = &[
    " ", "  ", "\t", "\n", "\r\n", ":", "-", "?", ",", "[", "]", "{", "}", "#", "&", "*", "!", "|", ">", "'", "\"", "%", "@", "`", "\\",
    "...", "---", "a", "b", "1", "0x", ".5", "e3", "~", "null", "true", "\u{feff}", "\u{85}", "\u{2028}", "é", "\\u00e9", "\\x",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

    #[test]
    fn any_text_is_a_tree_or_an_error_with_a_place(parts in prop::collection::vec(prop::sample::select(ALPHABET), 0..60)) {
        let text: String = parts.concat();
        match doc::parse(&text) {
            Ok(v) => {
                // What is accepted reads back the same through JSON.
                prop_assert_eq!(doc::parse(&doc::to_json(&v)).ok().map(|w| doc::to_json(&w)), Some(doc::to_json(&v)));
            }
            Err(e) => prop_assert!(e.message.starts_with("invalid document at line ") || e.message.contains("the limit is"), "{:?}", e.message),
        }
    }
}
