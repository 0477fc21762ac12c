//! A list answer (`{"kind":…,"metadata":{…},"items":[…]}`) read item by item as its bytes
//! arrive, so that a list of 150,000 pods is never held whole: each item is handed over as
//! the bytes of one JSON value the moment its last byte is in, and dropped after.
//!
//! It only finds where values begin and end (strings, escapes, nesting); each item and the
//! list's `metadata` are then decoded by serde_json, which checks them. Fields other than
//! `items` and `metadata` are skipped. It does not decode, allocate per object, or accept
//! anything but one JSON object at the top.

/// Why a list answer could not be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ListBodyError {
    /// A byte that a JSON list cannot hold there.
    #[error("not a JSON list: unexpected {found:?} at byte {offset}")]
    Syntax {
        /// Offset in the whole answer.
        offset: u64,
        /// The byte found.
        found: char,
    },
    /// The answer ended inside the list.
    #[error("the list answer ended after {0} bytes, before the list did")]
    Truncated(u64),
}

/// Where the reader is in the list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// Before the opening `{`.
    Open,
    /// After `{`: a key or `}`.
    FirstKey,
    /// After `,`: a key.
    Key,
    /// Inside a key's string.
    KeyString { escaped: bool },
    /// After a key: `:`.
    Colon,
    /// After `:`: the field's value.
    Value,
    /// Inside a field's value (skipped, or kept for `metadata`).
    InValue(Scan),
    /// After a field's value: `,` or `}`.
    AfterValue,
    /// After `"items":[`: an item or `]`.
    FirstItem,
    /// After `,` in the items: an item.
    Item,
    /// Inside an item.
    InItem(Scan),
    /// After an item: `,` or `]`.
    AfterItem,
    /// After the closing `}`: only whitespace may follow.
    Done,
}

/// Progress inside one JSON value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Scan {
    /// Open `{` and `[` (0 for a string or a scalar).
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// A number, `true`, `false` or `null`: ends before a delimiter.
    scalar: bool,
}

impl Scan {
    /// Starts a value at byte `b` (not whitespace).
    fn start(b: u8) -> Scan {
        Scan {
            depth: u32::from(b == b'{' || b == b'['),
            in_string: b == b'"',
            escaped: false,
            scalar: !matches!(b, b'{' | b'[' | b'"'),
        }
    }

    /// Feeds the byte after the value's first; true when the value ended WITH this byte
    /// (for a scalar: true when this byte is the delimiter after it, which is not part of it).
    fn feed(&mut self, b: u8) -> bool {
        if self.scalar {
            return matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r');
        }
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
                return self.depth == 0;
            }
            return false;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// What [`ListBody::next_piece`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// One item's JSON.
    Item(&'a [u8]),
    /// The list's `metadata` JSON.
    Metadata(&'a [u8]),
}

/// The reader of one list answer: [`push`](ListBody::push) bytes as they arrive, take the
/// pieces with [`next_piece`](ListBody::next_piece) until it answers `None`, and call
/// [`finish`](ListBody::finish) at the end of the answer.
#[derive(Debug)]
pub struct ListBody {
    buf: Vec<u8>,
    /// Next byte to look at, in `buf`.
    pos: usize,
    /// Where the value being read began, in `buf`.
    start: usize,
    /// Bytes dropped from the front of `buf` so far (for error offsets).
    dropped: u64,
    at: At,
    key: Vec<u8>,
}

impl Default for ListBody {
    fn default() -> Self {
        ListBody {
            buf: Vec::new(),
            pos: 0,
            start: 0,
            dropped: 0,
            at: At::Open,
            key: Vec::new(),
        }
    }
}

impl ListBody {
    /// Appends the next bytes of the answer (what was handed out before is dropped).
    pub fn push(&mut self, bytes: &[u8]) {
        let keep = match self.at {
            At::InValue(_) | At::InItem(_) => self.start,
            _ => self.pos,
        };
        if keep > 0 {
            self.buf.drain(..keep);
            self.dropped += keep as u64;
            self.pos -= keep;
            self.start = self.start.saturating_sub(keep);
        }
        self.buf.extend_from_slice(bytes);
    }

    fn error(&self, at: usize) -> ListBodyError {
        ListBodyError::Syntax {
            offset: self.dropped + at as u64,
            found: char::from(self.buf[at]),
        }
    }

    /// The next item or the metadata, once all its bytes are in; `None` when more bytes are
    /// needed (or the list is done).
    pub fn next_piece(&mut self) -> Result<Option<Piece<'_>>, ListBodyError> {
        while self.pos < self.buf.len() {
            let b = self.buf[self.pos];
            let here = self.pos;
            self.pos += 1;
            match self.at {
                At::Open
                | At::FirstKey
                | At::Key
                | At::Colon
                | At::Value
                | At::AfterValue
                | At::FirstItem
                | At::Item
                | At::AfterItem
                | At::Done
                    if is_space(b) => {}
                At::Open if b == b'{' => self.at = At::FirstKey,
                At::FirstKey if b == b'}' => self.at = At::Done,
                At::FirstKey | At::Key if b == b'"' => {
                    self.key.clear();
                    self.at = At::KeyString { escaped: false };
                }
                At::KeyString { escaped } => {
                    if escaped {
                        self.key.push(b);
                        self.at = At::KeyString { escaped: false };
                    } else if b == b'\\' {
                        self.key.push(b);
                        self.at = At::KeyString { escaped: true };
                    } else if b == b'"' {
                        self.at = At::Colon;
                    } else {
                        self.key.push(b);
                    }
                }
                At::Colon if b == b':' => self.at = At::Value,
                At::Value if b == b'[' && self.key == b"items" => self.at = At::FirstItem,
                At::Value if !matches!(b, b']' | b'}' | b',' | b':') => {
                    self.start = here;
                    self.at = At::InValue(Scan::start(b));
                }
                At::InValue(mut scan) => {
                    if scan.feed(b) {
                        // A scalar ends before its delimiter, which is read again.
                        let end = if scan.scalar {
                            self.pos -= 1;
                            here
                        } else {
                            here + 1
                        };
                        self.at = At::AfterValue;
                        if self.key == b"metadata" {
                            return Ok(Some(Piece::Metadata(&self.buf[self.start..end])));
                        }
                    } else {
                        self.at = At::InValue(scan);
                    }
                }
                At::AfterValue if b == b',' => self.at = At::Key,
                At::AfterValue if b == b'}' => self.at = At::Done,
                At::FirstItem if b == b']' => self.at = At::AfterValue,
                // A scalar item cannot be a Kubernetes object: it is handed over all the same
                // and refused when decoded.
                At::FirstItem | At::Item if !matches!(b, b']' | b'}' | b',' | b':') => {
                    self.start = here;
                    self.at = At::InItem(Scan::start(b));
                }
                At::InItem(mut scan) => {
                    if scan.feed(b) {
                        let end = if scan.scalar {
                            self.pos -= 1;
                            here
                        } else {
                            here + 1
                        };
                        self.at = At::AfterItem;
                        return Ok(Some(Piece::Item(&self.buf[self.start..end])));
                    }
                    self.at = At::InItem(scan);
                }
                At::AfterItem if b == b',' => self.at = At::Item,
                At::AfterItem if b == b']' => self.at = At::AfterValue,
                _ => return Err(self.error(here)),
            }
        }
        Ok(None)
    }

    /// The answer has ended: an error unless the list was closed.
    pub fn finish(&self) -> Result<(), ListBodyError> {
        if self.at == At::Done {
            Ok(())
        } else {
            Err(ListBodyError::Truncated(
                self.dropped + self.buf.len() as u64,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// Everything `text` yields when fed in pieces of `chunk` bytes.
    fn read(text: &[u8], chunk: usize) -> Result<(Vec<Value>, Option<Value>), ListBodyError> {
        let mut body = ListBody::default();
        let mut items = Vec::new();
        let mut metadata = None;
        for piece in text.chunks(chunk.max(1)) {
            body.push(piece);
            while let Some(p) = body.next_piece()? {
                match p {
                    Piece::Item(b) => items.push(serde_json::from_slice(b).expect("an item")),
                    Piece::Metadata(b) => {
                        metadata = Some(serde_json::from_slice(b).expect("metadata"))
                    }
                }
            }
        }
        body.finish()?;
        Ok((items, metadata))
    }

    #[test]
    fn items_and_metadata_come_out_whatever_the_chunks() {
        let list = json!({
            "kind": "PodList", "apiVersion": "v1",
            "metadata": {"resourceVersion": "42", "continue": "a\"b{"},
            "items": [
                {"metadata": {"name": "a]}\\\"", "labels": {"x": "[{"}}, "spec": {"n": [1, 2, {"a": []}]}},
                {"metadata": {"name": "b"}, "status": {"phase": "Running", "ok": true, "n": -1.5e3}}
            ],
            "extra": [1, "two", null, {"three": 3}]
        });
        let text = serde_json::to_vec_pretty(&list).unwrap();
        for chunk in [1, 2, 3, 7, 64, text.len()] {
            let (items, metadata) = read(&text, chunk).expect("reads");
            assert_eq!(Value::Array(items), list["items"], "chunks of {chunk}");
            assert_eq!(metadata.as_ref(), Some(&list["metadata"]));
        }
    }

    #[test]
    fn metadata_after_the_items_and_empty_or_null_items() {
        let (items, metadata) =
            read(br#"{"items":[],"metadata":{"resourceVersion":"7"}}"#, 5).unwrap();
        assert!(items.is_empty());
        assert_eq!(metadata, Some(json!({"resourceVersion": "7"})));
        let (items, _) = read(br#"{"items":null,"kind":"X","n":12}"#, 1).unwrap();
        assert!(items.is_empty());
        assert_eq!(read(b" {} ", 1).unwrap(), (Vec::new(), None));
    }

    #[test]
    fn broken_answers_are_errors_not_panics() {
        assert_eq!(
            read(br#"{"items":[{"a":1}"#, 3).unwrap_err(),
            ListBodyError::Truncated(17)
        );
        assert!(matches!(
            read(br#"[{"a":1}]"#, 3),
            Err(ListBodyError::Syntax {
                offset: 0,
                found: '['
            })
        ));
        assert!(matches!(
            read(br#"{"items":[{"a":1}}"#, 4),
            Err(ListBodyError::Syntax { offset: 17, .. })
        ));
        assert!(read(br#"{"items":[1,,2]}"#, 2).is_err());
        assert!(read(br#"{"a" "b"}"#, 2).is_err());
        assert!(read(br#"{} x"#, 2).is_err());
        assert!(read(b"", 2).is_err());
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            "[a-z\"\\\\{}\\[\\],: \u{e9}]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z\"{]{0,4}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any list, pretty or compact, cut anywhere, gives back exactly its items and metadata.
        #[test]
        fn any_list_cut_anywhere_reads_back(
            items in prop::collection::vec(json_value(), 0..6),
            meta in json_value(),
            pretty in any::<bool>(),
            chunk in 1usize..40,
        ) {
            let list = json!({"kind": "List", "metadata": meta, "items": items});
            let text = if pretty {
                serde_json::to_vec_pretty(&list).unwrap()
            } else {
                serde_json::to_vec(&list).unwrap()
            };
            let (got, metadata) = read(&text, chunk).unwrap();
            prop_assert_eq!(Value::Array(got), list["items"].clone());
            prop_assert_eq!(metadata, Some(list["metadata"].clone()));
        }
    }
}
