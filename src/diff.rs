//! Change detection without I/O: the content hash of a record and the decision
//! whether a listed record must be published, and as which kind of change.
//!
//! The content hash is blake3 (truncated to 128 bits) over a canonical form of
//! the record's JSON, so that representation noise never looks like a change:
//!
//! * object keys are sorted by the bytes of their canonical form;
//! * whitespace outside strings is dropped;
//! * strings are re-escaped canonically: only `"`, `\` and control characters
//!   are escaped (`\b \f \n \r \t`, others as lowercase `\u00xx`); every other
//!   character, however the input escaped it, is written as raw UTF-8;
//! * numbers are compared by value, exactly: the decimal text is normalised to
//!   `[-]digits[eEXP]` (leading zeros and trailing zeros dropped, the exponent
//!   folded in), so `25`, `25.0`, `25.00` and `2.5e1` hash the same and integers
//!   beyond 2^53 stay exact (no trip through `f64`);
//! * members whose key is in [`IgnoreKeys`] are dropped at any depth (inside
//!   nested objects and objects inside arrays).
//!
//! Duplicate keys are kept, in input order among themselves.

use std::cell::RefCell;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::event::Op;

/// Deepest nesting of arrays and objects accepted, to bound recursion.
const MAX_DEPTH: usize = 128;

/// A 128-bit content hash of a record's canonical JSON.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentHash(pub [u8; 16]);

impl ContentHash {
    /// The 32 lowercase hex digits of the hash.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses 32 hex digits.
    pub fn from_hex(text: &str) -> Result<ContentHash, DiffError> {
        let mut bytes = [0u8; 16];
        hex::decode_to_slice(text, &mut bytes).map_err(|e| DiffError::InvalidHash {
            text: text.chars().take(40).collect(),
            reason: e.to_string(),
        })?;
        Ok(ContentHash(bytes))
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 32];
        // Encoding 16 bytes into a 32-byte buffer cannot fail.
        if hex::encode_to_slice(self.0, &mut buf).is_err() {
            return Err(fmt::Error);
        }
        // Hex digits are ASCII.
        f.write_str(std::str::from_utf8(&buf).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({self})")
    }
}

impl FromStr for ContentHash {
    type Err = DiffError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ContentHash::from_hex(s)
    }
}

impl Serialize for ContentHash {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ContentHash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        ContentHash::from_hex(&text).map_err(serde::de::Error::custom)
    }
}

/// Why a record could not be hashed, or a hash could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiffError {
    /// The record is not valid JSON.
    #[error("invalid json at byte {offset}: {reason}")]
    InvalidJson {
        /// Byte offset of the problem in the record text.
        offset: usize,
        /// What was wrong there.
        reason: &'static str,
    },
    /// A content hash in text form is not 32 hex digits.
    #[error("invalid content hash `{text}`: {reason}")]
    InvalidHash {
        /// The offending text (truncated).
        text: String,
        /// What was wrong with it.
        reason: String,
    },
}

/// Object keys left out of the content hash at any depth (`poll.ignore_keys`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IgnoreKeys {
    /// Canonical escaped bytes of each key, without quotes.
    keys: Vec<Vec<u8>>,
}

impl IgnoreKeys {
    /// Builds the set from key names as written in the config.
    pub fn new<I, S>(keys: I) -> IgnoreKeys
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut canonical: Vec<Vec<u8>> = keys
            .into_iter()
            .map(|k| {
                let mut out = Vec::with_capacity(k.as_ref().len());
                for ch in k.as_ref().chars() {
                    write_char(&mut out, ch);
                }
                out
            })
            .collect();
        canonical.sort();
        canonical.dedup();
        IgnoreKeys { keys: canonical }
    }

    /// An empty set: every key counts.
    pub fn none() -> IgnoreKeys {
        IgnoreKeys { keys: Vec::new() }
    }

    /// True when no key is ignored.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn contains(&self, canonical_key: &[u8]) -> bool {
        self.keys.iter().any(|k| k.as_slice() == canonical_key)
    }
}

impl Default for IgnoreKeys {
    /// The config default: `["updated_at"]`.
    fn default() -> Self {
        IgnoreKeys::new(["updated_at"])
    }
}

/// Computes the content hash of one record's raw JSON text.
pub fn content_hash(raw: &str, ignore: &IgnoreKeys) -> Result<ContentHash, DiffError> {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => hash_with(&mut scratch, raw, ignore),
        // Only reachable through re-entrancy, which this module never does.
        Err(_) => hash_with(&mut Scratch::default(), raw, ignore),
    })
}

/// Writes the canonical form of `raw` into `out` (cleared first); exposed for
/// tests and debugging (`content_hash` is blake3 over exactly these bytes).
pub fn canonical_json(raw: &str, ignore: &IgnoreKeys, out: &mut Vec<u8>) -> Result<(), DiffError> {
    let mut scratch = Scratch::default();
    canonicalize(&mut scratch, raw, ignore)?;
    out.clear();
    out.extend_from_slice(&scratch.out);
    Ok(())
}

fn hash_with(
    scratch: &mut Scratch,
    raw: &str,
    ignore: &IgnoreKeys,
) -> Result<ContentHash, DiffError> {
    canonicalize(scratch, raw, ignore)?;
    let digest = blake3::hash(&scratch.out);
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest.as_bytes()[..16]);
    // Do not let one huge record pin a huge buffer for the thread's lifetime.
    scratch.shrink();
    Ok(ContentHash(bytes))
}

/// How the sweep that listed a record treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SweepMode {
    /// The stream's first sync: every new or changed record is a snapshot.
    FirstSync,
    /// A normal incremental or full sweep.
    Normal,
    /// A replay: every listed record is a snapshot, whatever its hash.
    Replay,
}

/// Whether a listed record must be published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The stored hash matches: nothing to publish.
    Unchanged,
    /// Publish an event of this kind; `previous` is the stored hash, if any.
    Emit {
        /// The kind of change.
        op: Op,
        /// The hash known before this sweep.
        previous: Option<ContentHash>,
    },
}

/// Decides what to do with a listed record given the hash the store knows.
pub fn decide(known: Option<ContentHash>, new: ContentHash, mode: SweepMode) -> Decision {
    let unchanged = known == Some(new);
    match mode {
        SweepMode::Replay => Decision::Emit {
            op: Op::Snapshot,
            previous: known,
        },
        SweepMode::FirstSync if unchanged => Decision::Unchanged,
        SweepMode::FirstSync => Decision::Emit {
            op: Op::Snapshot,
            previous: known,
        },
        SweepMode::Normal => match known {
            None => Decision::Emit {
                op: Op::Create,
                previous: None,
            },
            Some(_) if unchanged => Decision::Unchanged,
            Some(previous) => Decision::Emit {
                op: Op::Update,
                previous: Some(previous),
            },
        },
    }
}

// ---------------------------------------------------------------------------
// Canonicalizer
// ---------------------------------------------------------------------------

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Reusable buffers, so hashing a record allocates nothing in steady state.
#[derive(Default)]
struct Scratch {
    /// Canonical output.
    out: Vec<u8>,
    /// Member spans of the objects currently open, innermost last.
    members: Vec<Member>,
    /// Copy of an unsorted object's members while they are reordered.
    reorder: Vec<u8>,
    /// Number digits while a number is normalised.
    digits: Vec<u8>,
}

impl Scratch {
    fn shrink(&mut self) {
        const KEEP: usize = 1 << 20;
        if self.out.capacity() > KEEP {
            self.out = Vec::new();
        }
        if self.reorder.capacity() > KEEP {
            self.reorder = Vec::new();
        }
        if self.members.capacity() > KEEP / 16 {
            self.members = Vec::new();
        }
    }
}

/// Byte spans (in `Scratch::out`) of one object member: `"key":value`.
#[derive(Clone, Copy)]
struct Member {
    /// Start of the opening quote of the key.
    start: u32,
    /// End of the closing quote of the key (the `:` follows).
    key_end: u32,
    /// End of the value.
    end: u32,
}

impl Member {
    fn key<'a>(&self, out: &'a [u8]) -> &'a [u8] {
        &out[self.start as usize + 1..self.key_end as usize - 1]
    }
}

fn canonicalize(scratch: &mut Scratch, raw: &str, ignore: &IgnoreKeys) -> Result<(), DiffError> {
    scratch.out.clear();
    scratch.members.clear();
    if raw.len() >= u32::MAX as usize / 2 {
        return Err(DiffError::InvalidJson {
            offset: 0,
            reason: "record larger than 2 GiB",
        });
    }
    let mut parser = Parser {
        input: raw.as_bytes(),
        pos: 0,
        ignore,
        scratch,
    };
    parser.skip_ws();
    parser.value(0)?;
    parser.skip_ws();
    if parser.pos != parser.input.len() {
        return Err(parser.error("trailing characters after the json value"));
    }
    Ok(())
}

struct Parser<'a, 's> {
    input: &'a [u8],
    pos: usize,
    ignore: &'a IgnoreKeys,
    scratch: &'s mut Scratch,
}

impl Parser<'_, '_> {
    fn error(&self, reason: &'static str) -> DiffError {
        DiffError::InvalidJson {
            offset: self.pos,
            reason,
        }
    }

    #[inline]
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    #[inline]
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.pos += 1;
        }
    }

    fn value(&mut self, depth: usize) -> Result<(), DiffError> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string(),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(_) => Err(self.error("expected a json value")),
            None => Err(self.error("unexpected end of input, expected a json value")),
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), DiffError> {
        if self.input[self.pos..].starts_with(word) {
            self.pos += word.len();
            self.scratch.out.extend_from_slice(word);
            Ok(())
        } else {
            Err(self.error("invalid literal, expected true, false or null"))
        }
    }

    fn array(&mut self, depth: usize) -> Result<(), DiffError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting deeper than 128 levels"));
        }
        self.pos += 1; // '['
        self.scratch.out.push(b'[');
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.scratch.out.push(b']');
            return Ok(());
        }
        loop {
            self.skip_ws();
            self.value(depth)?;
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.scratch.out.push(b',');
                }
                Some(b']') => {
                    self.pos += 1;
                    self.scratch.out.push(b']');
                    return Ok(());
                }
                Some(_) => return Err(self.error("expected ',' or ']' in array")),
                None => return Err(self.error("unexpected end of input inside an array")),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<(), DiffError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting deeper than 128 levels"));
        }
        self.pos += 1; // '{'
        let object_start = self.scratch.out.len();
        self.scratch.out.push(b'{');
        let first_member = self.scratch.members.len();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.scratch.out.push(b'}');
            return Ok(());
        }
        let mut sorted = true;
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a string key in object"));
            }
            let separator_at = self.scratch.out.len();
            let written = self.scratch.members.len() - first_member;
            if written > 0 {
                self.scratch.out.push(b',');
            }
            let start = self.scratch.out.len();
            self.string()?;
            let key_end = self.scratch.out.len();
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.error("expected ':' after object key"));
            }
            self.pos += 1;
            self.scratch.out.push(b':');
            self.skip_ws();
            self.value(depth)?;
            let member = Member {
                start: start as u32,
                key_end: key_end as u32,
                end: self.scratch.out.len() as u32,
            };
            if self.ignore.contains(member.key(&self.scratch.out)) {
                self.scratch.out.truncate(separator_at);
            } else {
                if let Some(last) = self.scratch.members[first_member..].last() {
                    if last.key(&self.scratch.out) > member.key(&self.scratch.out) {
                        sorted = false;
                    }
                }
                self.scratch.members.push(member);
            }
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => return Err(self.error("expected ',' or '}' in object")),
                None => return Err(self.error("unexpected end of input inside an object")),
            }
        }
        if !sorted {
            self.reorder(object_start, first_member);
        }
        self.scratch.members.truncate(first_member);
        self.scratch.out.push(b'}');
        Ok(())
    }

    /// Rewrites the members of the object starting at `object_start` in key order.
    fn reorder(&mut self, object_start: usize, first_member: usize) {
        let scratch = &mut *self.scratch;
        let body_start = object_start + 1;
        scratch.reorder.clear();
        scratch
            .reorder
            .extend_from_slice(&scratch.out[body_start..]);
        let copy = &scratch.reorder;
        let members = &mut scratch.members[first_member..];
        let offset = body_start as u32;
        // Stable: duplicate keys keep their input order.
        members.sort_by(|a, b| {
            let ka = &copy[(a.start - offset) as usize + 1..(a.key_end - offset) as usize - 1];
            let kb = &copy[(b.start - offset) as usize + 1..(b.key_end - offset) as usize - 1];
            ka.cmp(kb)
        });
        scratch.out.truncate(body_start);
        for (i, m) in members.iter().enumerate() {
            if i > 0 {
                scratch.out.push(b',');
            }
            scratch
                .out
                .extend_from_slice(&copy[(m.start - offset) as usize..(m.end - offset) as usize]);
        }
    }

    fn string(&mut self) -> Result<(), DiffError> {
        self.pos += 1; // opening quote
        self.scratch.out.push(b'"');
        loop {
            // Fast path: copy a run of bytes that need no escaping.
            let run_start = self.pos;
            while let Some(&b) = self.input.get(self.pos) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            self.scratch
                .out
                .extend_from_slice(&self.input[run_start..self.pos]);
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    self.scratch.out.push(b'"');
                    return Ok(());
                }
                Some(b'\\') => {
                    self.pos += 1;
                    self.escape()?;
                }
                Some(_) => return Err(self.error("control character inside a string")),
                None => return Err(self.error("unexpected end of input inside a string")),
            }
        }
    }

    /// Decodes one escape (after the backslash) and writes it canonically.
    fn escape(&mut self) -> Result<(), DiffError> {
        let ch = match self.peek() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.pos += 1;
                let unit = self.hex4()?;
                return self.unicode_escape(unit);
            }
            Some(_) => return Err(self.error("invalid escape in string")),
            None => return Err(self.error("unexpected end of input inside a string")),
        };
        self.pos += 1;
        write_char(&mut self.scratch.out, ch);
        Ok(())
    }

    /// Writes the character of a `\uXXXX` escape, joining surrogate pairs.
    fn unicode_escape(&mut self, unit: u16) -> Result<(), DiffError> {
        let ch = match unit {
            0xD800..=0xDBFF if self.input[self.pos..].starts_with(b"\\u") => {
                let before_low = self.pos;
                self.pos += 2;
                let low = self.hex4()?;
                if (0xDC00..=0xDFFF).contains(&low) {
                    let code =
                        0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00);
                    char::from_u32(code)
                } else {
                    self.pos = before_low;
                    None
                }
            }
            0xD800..=0xDFFF => None,
            _ => char::from_u32(u32::from(unit)),
        };
        match ch {
            Some(ch) => write_char(&mut self.scratch.out, ch),
            None => {
                // A lone surrogate has no UTF-8 form: keep it as a canonical
                // lowercase escape.
                let out = &mut self.scratch.out;
                out.extend_from_slice(b"\\u");
                for shift in [12u32, 8, 4, 0] {
                    out.push(HEX[usize::from((unit >> shift) & 0xf)]);
                }
            }
        }
        Ok(())
    }

    fn hex4(&mut self) -> Result<u16, DiffError> {
        let Some(digits) = self.input.get(self.pos..self.pos + 4) else {
            return Err(self.error("truncated \\u escape"));
        };
        let mut value: u16 = 0;
        for &d in digits {
            let nibble = match d {
                b'0'..=b'9' => d - b'0',
                b'a'..=b'f' => d - b'a' + 10,
                b'A'..=b'F' => d - b'A' + 10,
                _ => return Err(self.error("invalid hex digit in \\u escape")),
            };
            value = (value << 4) | u16::from(nibble);
        }
        self.pos += 4;
        Ok(value)
    }

    fn digit_run(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    /// Writes a number as `[-]digits[eEXP]` with no leading or trailing zeros
    /// in `digits`, except that an exponent in 0..=15 is written as plain
    /// trailing zeros (so integers look like integers). Zero is `0`.
    fn number(&mut self) -> Result<(), DiffError> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int_start = self.pos;
        match self.peek() {
            Some(b'0') => {
                self.pos += 1;
                if let Some(b'0'..=b'9') = self.peek() {
                    return Err(self.error("leading zero in number"));
                }
            }
            Some(b'1'..=b'9') => {
                self.digit_run();
            }
            _ => return Err(self.error("expected a digit in number")),
        }
        let int_end = self.pos;
        let mut frac = (self.pos, self.pos);
        if self.peek() == Some(b'.') {
            self.pos += 1;
            let start = self.pos;
            if self.digit_run() == 0 {
                return Err(self.error("expected a digit after the decimal point"));
            }
            frac = (start, self.pos);
        }
        let mut exponent: i64 = 0;
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            let exp_negative = match self.peek() {
                Some(b'-') => {
                    self.pos += 1;
                    true
                }
                Some(b'+') => {
                    self.pos += 1;
                    false
                }
                _ => false,
            };
            let start = self.pos;
            if self.digit_run() == 0 {
                return Err(self.error("expected a digit in the exponent"));
            }
            for &d in &self.input[start..self.pos] {
                exponent = exponent
                    .checked_mul(10)
                    .and_then(|e| e.checked_add(i64::from(d - b'0')))
                    .ok_or_else(|| self.error("number exponent out of range"))?;
            }
            if exp_negative {
                exponent = -exponent;
            }
        }
        let input = self.input;
        let int_digits = &input[int_start..int_end];
        let frac_digits = &input[frac.0..frac.1];
        let digits = &mut self.scratch.digits;
        digits.clear();
        digits.extend_from_slice(int_digits);
        digits.extend_from_slice(frac_digits);
        let leading = digits.iter().take_while(|&&d| d == b'0').count();
        if leading == digits.len() {
            self.scratch.out.push(b'0');
            return Ok(());
        }
        let trailing = digits.iter().rev().take_while(|&&d| d == b'0').count();
        let significant = &digits[leading..digits.len() - trailing];
        let exponent = i64::try_from(trailing)
            .ok()
            .and_then(|t| exponent.checked_add(t))
            .and_then(|e| {
                i64::try_from(frac_digits.len())
                    .ok()
                    .and_then(|f| e.checked_sub(f))
            })
            .ok_or_else(|| DiffError::InvalidJson {
                offset: self.pos,
                reason: "number exponent out of range",
            })?;
        let out = &mut self.scratch.out;
        if negative {
            out.push(b'-');
        }
        out.extend_from_slice(significant);
        if (0..=15).contains(&exponent) {
            out.resize(out.len() + exponent as usize, b'0');
        } else {
            out.push(b'e');
            write_i64(out, exponent);
        }
        Ok(())
    }
}

/// Writes an integer in decimal.
fn write_i64(out: &mut Vec<u8>, value: i64) {
    if value < 0 {
        out.push(b'-');
    }
    let mut magnitude = value.unsigned_abs();
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (magnitude % 10) as u8;
        magnitude /= 10;
        if magnitude == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

/// Writes one character in canonical escaped form.
#[inline]
fn write_char(out: &mut Vec<u8>, ch: char) {
    match ch {
        '"' => out.extend_from_slice(b"\\\""),
        '\\' => out.extend_from_slice(b"\\\\"),
        '\u{8}' => out.extend_from_slice(b"\\b"),
        '\u{c}' => out.extend_from_slice(b"\\f"),
        '\n' => out.extend_from_slice(b"\\n"),
        '\r' => out.extend_from_slice(b"\\r"),
        '\t' => out.extend_from_slice(b"\\t"),
        c if (c as u32) < 0x20 => {
            out.extend_from_slice(b"\\u00");
            let v = c as u8;
            out.push(HEX[(v >> 4) as usize]);
            out.push(HEX[(v & 0xf) as usize]);
        }
        c => {
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";
