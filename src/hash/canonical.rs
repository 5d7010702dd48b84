//! The canonical form of a record's JSON, written by a single pass over the
//! raw text (no `serde_json::Value`, no trip of numbers through `f64`):
//!
//! * object keys are sorted by the bytes of their canonical form;
//! * whitespace outside strings is dropped;
//! * strings are re-escaped canonically: only `"`, `\` and control characters
//!   are escaped (`\b \f \n \r \t`, others as lowercase `\u00xx`); every other
//!   character, however the input escaped it, is written as raw UTF-8;
//! * numbers are compared by value, exactly: the decimal text is normalised to
//!   `[-]digits[eEXP]` (leading zeros and trailing zeros dropped, the exponent
//!   folded in), so `25`, `25.0`, `25.00` and `2.5e1` hash the same and integers
//!   beyond 2^53 stay exact;
//! * members whose key is in [`IgnoreKeys`] are dropped at any depth (inside
//!   nested objects and objects inside arrays).
//!
//! Duplicate keys are kept, in input order among themselves. The full
//! specification is in docs/state.md ("The canonical form").

use std::cell::RefCell;

use super::{HashError, IgnoreKeys};

/// Deepest nesting of arrays and objects accepted, to bound recursion.
const MAX_DEPTH: usize = 128;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `use_bytes` over the canonical form of `raw`, built in this thread's
/// reusable buffers.
pub(super) fn with_canonical<R>(
    raw: &str,
    ignore: &IgnoreKeys,
    use_bytes: impl FnOnce(&[u8]) -> R,
) -> Result<R, HashError> {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => canonicalize_then(&mut scratch, raw, ignore, use_bytes),
        // Only reachable when `use_bytes` itself canonicalises.
        Err(_) => canonicalize_then(&mut Scratch::default(), raw, ignore, use_bytes),
    })
}

/// Canonicalises `raw` into `scratch`, hands the bytes to `use_bytes`, then
/// shrinks the buffers.
fn canonicalize_then<R>(
    scratch: &mut Scratch,
    raw: &str,
    ignore: &IgnoreKeys,
    use_bytes: impl FnOnce(&[u8]) -> R,
) -> Result<R, HashError> {
    canonicalize(scratch, raw, ignore)?;
    let result = use_bytes(&scratch.out);
    // Do not let one huge record pin a huge buffer for the thread's lifetime.
    scratch.shrink();
    Ok(result)
}

/// Where a top-level member of a record was found while its canonical form
/// was written: the byte range of its value in the input.
pub(crate) type ValueSpan = std::ops::Range<usize>;

/// What one pass over a record gives besides its canonical form: where the
/// record ends in the input, and the input spans of its top-level `id` and
/// `updated_at` values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RecordHead {
    /// One past the record's last byte in the input.
    pub(crate) end: usize,
    /// The top-level `id` value, when the record is an object with one.
    pub(crate) id: Option<ValueSpan>,
    /// The top-level `updated_at` value.
    pub(crate) updated_at: Option<ValueSpan>,
    /// False when a top-level key is written with an escape, or `id` or
    /// `updated_at` appears twice: then the spans may not be what a JSON
    /// reader would take for those fields.
    pub(crate) plain: bool,
}

/// Runs `use_bytes` over the canonical form of the one JSON value starting at
/// `start` in `input` (whitespace before it skipped, anything after it left
/// alone), and returns its result with the value's [`RecordHead`]: the
/// parse that hashes a listed record also finds where it ends and its
/// `id` and `updated_at`, so a page is read once.
pub(super) fn with_canonical_at<R>(
    input: &str,
    start: usize,
    ignore: &IgnoreKeys,
    use_bytes: impl FnOnce(&[u8]) -> R,
) -> Result<(R, RecordHead), HashError> {
    let run = |scratch: &mut Scratch| {
        let head = canonicalize_value(scratch, input, start, ignore)?;
        let result = use_bytes(&scratch.out);
        scratch.shrink();
        Ok((result, head))
    };
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => run(&mut scratch),
        Err(_) => run(&mut Scratch::default()),
    })
}

/// A key name in the canonical escaped form object keys are compared in
/// (without quotes).
pub(super) fn escape_key(key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len());
    for ch in key.chars() {
        write_char(&mut out, ch);
    }
    out
}

/// Reusable buffers, so hashing a record allocates nothing in steady state.
#[derive(Default)]
struct Scratch {
    /// Canonical output: first in input member order, then (when some object
    /// was out of order) written once more in key order.
    out: Vec<u8>,
    /// Member spans of the objects currently open, innermost last.
    members: Vec<Member>,
    /// Every non-empty object parsed, in the order they open (see [`Object`]).
    objects: Vec<Object>,
    /// The members of each out-of-order object, sorted by key.
    sorted: Vec<Member>,
    /// The output in key order, written from `out` by [`emit_sorted`] when
    /// some object was out of order, then swapped with `out`.
    resorted: Vec<u8>,
    /// (key prefix, position) of the members of the object being sorted.
    order: Vec<u128>,
    /// Key orders of the object shapes sorted recently (see [`ShapeCache`]).
    shapes: ShapeCache,
    /// Number digits while a number is normalised.
    digits: Vec<u8>,
    /// Tests: sort each object in place when it closes, as earlier versions
    /// did (copying it out and back at every level), to compare against.
    #[cfg(test)]
    eager: bool,
    /// Tests: copy of an unsorted object's members while they are reordered in place.
    #[cfg(test)]
    reorder: Vec<u8>,
}

impl Scratch {
    fn shrink(&mut self) {
        const KEEP: usize = 1 << 20;
        if self.out.capacity() > KEEP {
            self.out = Vec::new();
        }
        if self.resorted.capacity() > KEEP {
            self.resorted = Vec::new();
        }
        for spans in [&mut self.members, &mut self.sorted] {
            if spans.capacity() > KEEP / 32 {
                *spans = Vec::new();
            }
        }
        if self.objects.capacity() > KEEP / 32 {
            self.objects = Vec::new();
        }
        if self.order.capacity() > KEEP / 32 {
            self.order = Vec::new();
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
    /// The objects opened inside the value: `Scratch::objects[objects_lo..objects_hi]`.
    objects_lo: u32,
    /// See `objects_lo`.
    objects_hi: u32,
    /// The key's first eight bytes, big-endian, zero-padded: orders most keys
    /// without touching the bytes again.
    prefix: u64,
}

impl Member {
    fn key<'a>(&self, out: &'a [u8]) -> &'a [u8] {
        &out[self.start as usize + 1..self.key_end as usize - 1]
    }
}

/// One non-empty object as written to `Scratch::out` in input order.
#[derive(Clone, Copy)]
struct Object {
    /// Start of its members (just after the `{`).
    body_start: u32,
    /// End of its members (the `}`).
    body_end: u32,
    /// Index in `Scratch::objects` after the last object nested in it.
    skip: u32,
    /// Its members in key order, `Scratch::sorted[sorted_lo..sorted_hi]`;
    /// an empty range when they already were in key order.
    sorted_lo: u32,
    /// See `sorted_lo`.
    sorted_hi: u32,
}

#[cfg(test)]
impl Scratch {
    /// Rewrites the members of the object starting at `object_start` in key
    /// order, in place: the reorder of earlier versions, kept for tests to
    /// compare the single write in key order against.
    fn reorder_in_place(&mut self, object_start: usize, first_member: usize) {
        let body_start = object_start + 1;
        self.reorder.clear();
        self.reorder.extend_from_slice(&self.out[body_start..]);
        let copy = &self.reorder;
        let members = &mut self.members[first_member..];
        let offset = body_start as u32;
        members.sort_by(|a, b| {
            let ka = &copy[(a.start - offset) as usize + 1..(a.key_end - offset) as usize - 1];
            let kb = &copy[(b.start - offset) as usize + 1..(b.key_end - offset) as usize - 1];
            cmp_keys(a.prefix, ka, b.prefix, kb)
        });
        self.out.truncate(body_start);
        for (i, m) in members.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.out
                .extend_from_slice(&copy[(m.start - offset) as usize..(m.end - offset) as usize]);
        }
    }
}

/// The first eight bytes of `key` as a big-endian integer, zero-padded.
///
/// Canonical key bytes are never zero (control characters are escaped), so
/// comparing prefixes and then, on a tie, whole keys is byte order.
#[inline]
fn key_prefix(key: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    let n = key.len().min(8);
    buf[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(buf)
}

/// Byte order of two keys, given their prefixes.
#[inline]
fn cmp_keys(a_prefix: u64, a: &[u8], b_prefix: u64, b: &[u8]) -> std::cmp::Ordering {
    a_prefix.cmp(&b_prefix).then_with(|| a.cmp(b))
}

fn canonicalize(scratch: &mut Scratch, raw: &str, ignore: &IgnoreKeys) -> Result<(), HashError> {
    let head = canonicalize_value(scratch, raw, 0, ignore)?;
    let rest = &raw.as_bytes()[head.end..];
    let trailing = rest
        .iter()
        .position(|b| !matches!(b, b' ' | b'\n' | b'\r' | b'\t'));
    if let Some(at) = trailing {
        return Err(HashError::InvalidJson {
            offset: head.end + at,
            reason: "trailing characters after the json value",
        });
    }
    Ok(())
}

/// Writes the canonical form of the value starting at `start` (after any
/// whitespace) into `scratch.out`; returns where it ends and its head.
fn canonicalize_value(
    scratch: &mut Scratch,
    input: &str,
    start: usize,
    ignore: &IgnoreKeys,
) -> Result<RecordHead, HashError> {
    scratch.out.clear();
    scratch.members.clear();
    scratch.objects.clear();
    scratch.sorted.clear();
    if input.len() >= u32::MAX as usize / 2 {
        return Err(HashError::InvalidJson {
            offset: 0,
            reason: "record larger than 2 GiB",
        });
    }
    let mut parser = Parser {
        input: input.as_bytes(),
        pos: start,
        pending: start,
        ignore,
        scratch,
        head: RecordHead {
            plain: true,
            ..RecordHead::default()
        },
    };
    parser.skip_ws();
    parser.value(0)?;
    parser.flush();
    let mut head = parser.head;
    head.end = parser.pos;
    if !scratch.sorted.is_empty() {
        // Some object was out of order: write everything once more, each
        // object's members in key order, nested objects included.
        let Scratch {
            out,
            objects,
            sorted,
            resorted,
            ..
        } = scratch;
        resorted.clear();
        resorted.reserve(out.len());
        let all = Span {
            start: 0,
            end: out.len() as u32,
            objects_lo: 0,
            objects_hi: objects.len() as u32,
        };
        emit_sorted(out, objects, sorted, all, resorted);
        std::mem::swap(out, resorted);
    }
    Ok(head)
}

/// Appends `members` to `sorted` in key order; stable: duplicate keys keep
/// their input order.
///
/// Records of one kind list their keys in the same order, so most objects
/// have a shape sorted before: [`ShapeCache`] gives its order back for the
/// price of comparing the prefixes. Otherwise sorts (key prefix, position)
/// pairs, which orders every key whose first eight bytes differ from its
/// neighbours' without touching the key bytes or moving the spans; only runs
/// of equal prefixes are then ordered by the whole key (a prefix tie of keys
/// of at most eight bytes is an equal key).
fn sort_members(
    out: &[u8],
    members: &[Member],
    order: &mut Vec<u128>,
    shapes: &mut ShapeCache,
    sorted: &mut Vec<Member>,
) {
    let slot = shapes.slot(members);
    if let Some(known) = slot.and_then(|slot| shapes.order(slot, out, members)) {
        sorted.extend(known.iter().map(|&i| members[i as usize]));
        return;
    }
    order.clear();
    order.extend(
        members
            .iter()
            .enumerate()
            .map(|(i, m)| (u128::from(m.prefix) << 64) | i as u128),
    );
    // Positions are unique, so this is the stable order by prefix.
    order.sort_unstable();
    let prefix = |o: u128| (o >> 64) as u64;
    let member = |o: u128| &members[o as u64 as usize];
    let mut run = 0;
    while run < order.len() {
        let end = run
            + order[run..]
                .iter()
                .take_while(|&&o| prefix(o) == prefix(order[run]))
                .count();
        if end - run > 1 {
            // In position order already, and `sort_by` is stable.
            order[run..end].sort_by(|&a, &b| member(a).key(out).cmp(member(b).key(out)));
        }
        run = end;
    }
    sorted.extend(order.iter().map(|&o| *member(o)));
    if let Some(slot) = slot {
        shapes.remember(slot, members, order);
    }
}

/// The key order of recently sorted object shapes, a small direct-mapped
/// table keyed by the sequence of key prefixes in input order.
///
/// An object with the same prefix sequence as a remembered shape has its
/// order wherever prefixes differ, whatever its keys' bytes past the eighth.
/// Where neighbours in that order share a prefix (`image_url` and
/// `image_urls`), their whole keys are compared once more: when each such
/// pair is still in order, and equal keys in input order, the order is the
/// one a stable sort would give; else the object is sorted. Bounded:
/// [`ShapeCache::SLOTS`] shapes of at most [`ShapeCache::MAX_KEYS`] keys.
#[derive(Default)]
struct ShapeCache {
    /// Filled on first use; a slot is overwritten by the next shape that maps to it.
    slots: Vec<Shape>,
}

/// One remembered object shape.
#[derive(Default)]
struct Shape {
    /// The key prefixes, in input order.
    prefixes: Vec<u64>,
    /// Input positions, in key order.
    order: Vec<u32>,
    /// The places `i` in `order` where `order[i]` and `order[i + 1]` share
    /// their prefix.
    ties: Vec<u32>,
}

impl ShapeCache {
    const SLOTS: usize = 64;
    const MAX_KEYS: usize = 64;

    /// The slot of the shape of `members`; None for shapes too large to keep.
    #[inline]
    fn slot(&self, members: &[Member]) -> Option<usize> {
        if members.len() > Self::MAX_KEYS {
            return None;
        }
        let mut hash = members.len() as u64;
        for m in members {
            hash = (hash.rotate_left(5) ^ m.prefix).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
        Some((hash >> 58) as usize % Self::SLOTS)
    }

    /// The key order kept in `slot`, when it is the key order of `members`
    /// (whose keys are in `out`).
    #[inline]
    fn order(&self, slot: usize, out: &[u8], members: &[Member]) -> Option<&[u32]> {
        let shape = self.slots.get(slot)?;
        let same = shape.prefixes.len() == members.len()
            && shape
                .prefixes
                .iter()
                .zip(members)
                .all(|(&p, m)| p == m.prefix);
        if !same {
            return None;
        }
        let order = shape.order.as_slice();
        let ties_in_order = shape.ties.iter().all(|&i| {
            let (a, b) = (order[i as usize], order[i as usize + 1]);
            // Equal keys must be in input order: the shape's were, but
            // there they may have been two different keys.
            let (key_a, key_b) = (members[a as usize].key(out), members[b as usize].key(out));
            key_a.cmp(key_b).then(a.cmp(&b)).is_lt()
        });
        ties_in_order.then_some(order)
    }

    /// Keeps the key order `order` ((prefix, position) pairs in key order)
    /// of `members` in `slot`.
    fn remember(&mut self, slot: usize, members: &[Member], order: &[u128]) {
        if self.slots.is_empty() {
            self.slots.resize_with(Self::SLOTS, Shape::default);
        }
        let shape = &mut self.slots[slot];
        shape.prefixes.clear();
        shape.prefixes.extend(members.iter().map(|m| m.prefix));
        shape.order.clear();
        shape.order.extend(order.iter().map(|&o| o as u64 as u32));
        shape.ties.clear();
        shape.ties.extend(
            order
                .windows(2)
                .enumerate()
                .filter(|(_, pair)| pair[0] >> 64 == pair[1] >> 64)
                .map(|(i, _)| i as u32),
        );
    }
}

/// A range of `Scratch::out` and the objects opened inside it.
#[derive(Clone, Copy)]
struct Span {
    start: u32,
    end: u32,
    objects_lo: u32,
    objects_hi: u32,
}

/// Copies `span` of `out` (written in input order) to `dest`, writing the
/// members of every out-of-order object inside it in key order; recurses
/// into those members (at most one level per nesting level, so at most
/// [`MAX_DEPTH`] deep). Each byte is copied once.
fn emit_sorted(out: &[u8], objects: &[Object], sorted: &[Member], span: Span, dest: &mut Vec<u8>) {
    let mut pos = span.start as usize;
    let mut i = span.objects_lo as usize;
    while i < span.objects_hi as usize {
        let object = objects[i];
        if object.sorted_lo == object.sorted_hi {
            // In order: copied as it is; objects nested in it come next.
            i += 1;
            continue;
        }
        dest.extend_from_slice(&out[pos..object.body_start as usize]);
        let members = &sorted[object.sorted_lo as usize..object.sorted_hi as usize];
        for (n, m) in members.iter().enumerate() {
            if n > 0 {
                dest.push(b',');
            }
            if m.objects_lo == m.objects_hi {
                // No object inside: the member is final as parsed.
                dest.extend_from_slice(&out[m.start as usize..m.end as usize]);
                continue;
            }
            let member = Span {
                start: m.start,
                end: m.end,
                objects_lo: m.objects_lo,
                objects_hi: m.objects_hi,
            };
            emit_sorted(out, objects, sorted, member, dest);
        }
        pos = object.body_end as usize;
        i = object.skip as usize;
    }
    dest.extend_from_slice(&out[pos..span.end as usize]);
}

/// Parses one value and writes its canonical form.
///
/// The output is written lazily: as long as the input text is already
/// canonical (compact, keys without escapes, plain integers), nothing is
/// copied; the input bytes from `pending` to `pos` are owed to
/// `scratch.out` verbatim and copied in one piece when the output first
/// differs from the input (whitespace, an escape, a number written another
/// way, a dropped member, an object to sort) or at the end. So at any point
/// the canonical form so far is `scratch.out` followed by
/// `input[pending..pos]`, and positions in it ([`Parser::out_len`]) are final.
struct Parser<'a, 's> {
    input: &'a [u8],
    pos: usize,
    /// Start of the input bytes owed to the output verbatim (up to `pos`).
    pending: usize,
    ignore: &'a IgnoreKeys,
    scratch: &'s mut Scratch,
    /// The top-level members the caller reads, found on the way.
    head: RecordHead,
}

/// Where the canonical bytes of an object key are (without quotes): still
/// in the input (a key without escapes is written as it is), or in the output.
#[derive(Clone, Copy)]
enum KeyAt {
    Input(u32, u32),
    Out(u32, u32),
}

impl Parser<'_, '_> {
    fn error(&self, reason: &'static str) -> HashError {
        HashError::InvalidJson {
            offset: self.pos,
            reason,
        }
    }

    #[inline]
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    /// Length of the canonical form written so far, owed bytes included.
    #[inline]
    fn out_len(&self) -> usize {
        self.scratch.out.len() + (self.pos - self.pending)
    }

    /// Copies the bytes owed to the output, so `scratch.out` holds the whole
    /// canonical form so far.
    #[inline]
    fn flush(&mut self) {
        self.flush_to(self.pos);
    }

    /// Copies the owed bytes up to `at` (at most `pos`); the input from `at`
    /// on is not owed.
    #[inline]
    fn flush_to(&mut self, at: usize) {
        if self.pending < at {
            self.scratch
                .out
                .extend_from_slice(&self.input[self.pending..at]);
        }
        self.pending = at;
    }

    /// The canonical bytes of a key, wherever they are.
    fn key_bytes(&self, at: KeyAt) -> &[u8] {
        match at {
            KeyAt::Input(start, end) => &self.input[start as usize..end as usize],
            KeyAt::Out(start, end) => &self.scratch.out[start as usize..end as usize],
        }
    }

    #[inline]
    fn skip_ws(&mut self) {
        if let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.flush();
            while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
                self.pos += 1;
            }
            self.pending = self.pos;
        }
    }

    fn value(&mut self, depth: usize) -> Result<(), HashError> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(|_| ()),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(_) => Err(self.error("expected a json value")),
            None => Err(self.error("unexpected end of input, expected a json value")),
        }
    }

    /// A literal is written as it is.
    fn literal(&mut self, word: &'static [u8]) -> Result<(), HashError> {
        if self.input[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.error("invalid literal, expected true, false or null"))
        }
    }

    fn array(&mut self, depth: usize) -> Result<(), HashError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting deeper than 128 levels"));
        }
        self.pos += 1; // '[', written as it is
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(());
        }
        loop {
            self.skip_ws();
            self.value(depth)?;
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(());
                }
                Some(_) => return Err(self.error("expected ',' or ']' in array")),
                None => return Err(self.error("unexpected end of input inside an array")),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<(), HashError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting deeper than 128 levels"));
        }
        let object_start = self.out_len();
        self.pos += 1; // '{', written as it is
        let first_member = self.scratch.members.len();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(());
        }
        let index = self.scratch.objects.len();
        self.scratch.objects.push(Object {
            body_start: object_start as u32 + 1,
            body_end: 0,
            skip: 0,
            sorted_lo: 0,
            sorted_hi: 0,
        });
        let mut sorted = true;
        // Where this member's separating ',' starts (none before the first kept one).
        let mut separator_at = self.out_len();
        let mut last_key: Option<(u64, KeyAt)> = None;
        let body_end = loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a string key in object"));
            }
            let objects_lo = self.scratch.objects.len();
            let sorted_at = self.scratch.sorted.len();
            let start = self.out_len();
            let key_in = self.pos;
            let verbatim = self.string()?;
            if !verbatim {
                // Escapes were rewritten: the key is read from the output.
                self.flush();
            }
            let key_end = self.out_len();
            let key_in = key_in..self.pos;
            let key_at = if verbatim {
                KeyAt::Input(key_in.start as u32 + 1, key_in.end as u32 - 1)
            } else {
                KeyAt::Out(start as u32 + 1, key_end as u32 - 1)
            };
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.error("expected ':' after object key"));
            }
            self.pos += 1; // ':', written as it is
            self.skip_ws();
            let value_in = self.pos;
            self.value(depth)?;
            if depth == 1 {
                self.note_top_level(key_in, value_in..self.pos);
            }
            let key = self.key_bytes(key_at);
            let prefix = key_prefix(key);
            if self.ignore.contains(key) {
                // Dropped with its separator and every object nested in its value.
                self.flush();
                self.scratch.out.truncate(separator_at);
                self.scratch.objects.truncate(objects_lo);
                self.scratch.sorted.truncate(sorted_at);
            } else {
                if let Some((last_prefix, last_at)) = last_key {
                    if sorted && cmp_keys(last_prefix, self.key_bytes(last_at), prefix, key).is_gt()
                    {
                        sorted = false;
                    }
                }
                let member = Member {
                    start: start as u32,
                    key_end: key_end as u32,
                    end: self.out_len() as u32,
                    objects_lo: objects_lo as u32,
                    objects_hi: self.scratch.objects.len() as u32,
                    prefix,
                };
                self.scratch.members.push(member);
                last_key = Some((prefix, key_at));
            }
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    separator_at = self.out_len();
                    if self.scratch.members.len() > first_member {
                        self.pos += 1; // written as it is
                    } else {
                        // Every member so far was dropped: no separator.
                        self.flush();
                        self.pos += 1;
                        self.pending = self.pos;
                    }
                }
                Some(b'}') => {
                    let body_end = self.out_len();
                    self.pos += 1; // written as it is
                    break body_end;
                }
                Some(_) => return Err(self.error("expected ',' or '}' in object")),
                None => return Err(self.error("unexpected end of input inside an object")),
            }
        };
        let (sorted_lo, sorted_hi) = if sorted {
            (0, 0)
        } else {
            // The keys are compared in the output: it must hold them all.
            self.flush();
            let scratch = &mut *self.scratch;
            #[cfg(test)]
            if scratch.eager {
                scratch.out.truncate(body_end);
                scratch.reorder_in_place(object_start, first_member);
                scratch.out.push(b'}');
                return self.close_object(index, first_member, body_end, (0, 0));
            }
            let lo = scratch.sorted.len();
            sort_members(
                &scratch.out,
                &scratch.members[first_member..],
                &mut scratch.order,
                &mut scratch.shapes,
                &mut scratch.sorted,
            );
            (lo as u32, scratch.sorted.len() as u32)
        };
        self.close_object(index, first_member, body_end, (sorted_lo, sorted_hi))
    }

    /// Notes a top-level member whose key (quotes included) and value are
    /// at `key` and `value` in the input, when it is `id` or `updated_at`.
    fn note_top_level(&mut self, key: std::ops::Range<usize>, value: ValueSpan) {
        let name = &self.input[key.start + 1..key.end - 1];
        let slot = match name {
            b"id" => &mut self.head.id,
            b"updated_at" => &mut self.head.updated_at,
            _ => {
                if name.contains(&b'\\') {
                    self.head.plain = false;
                }
                return;
            }
        };
        if slot.is_some() {
            self.head.plain = false;
        }
        *slot = Some(value);
    }

    /// Ends the object `index`, whose members start at `first_member` and
    /// whose `}` is at `body_end` in the output.
    fn close_object(
        &mut self,
        index: usize,
        first_member: usize,
        body_end: usize,
        (sorted_lo, sorted_hi): (u32, u32),
    ) -> Result<(), HashError> {
        let scratch = &mut *self.scratch;
        let skip = scratch.objects.len() as u32;
        let object = &mut scratch.objects[index];
        object.body_end = body_end as u32;
        object.skip = skip;
        object.sorted_lo = sorted_lo;
        object.sorted_hi = sorted_hi;
        scratch.members.truncate(first_member);
        Ok(())
    }

    /// Writes a string; true when its canonical form is the input text as it
    /// is (no escapes), which is then still owed.
    #[inline(always)]
    fn string(&mut self) -> Result<bool, HashError> {
        self.pos += 1; // opening quote, written as it is
        let mut verbatim = true;
        loop {
            // Bytes that need no escaping are written as they are.
            self.pos = plain_run_end(self.input, self.pos);
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(verbatim);
                }
                Some(b'\\') => {
                    self.flush();
                    self.pos += 1;
                    self.escape()?;
                    self.pending = self.pos;
                    verbatim = false;
                }
                Some(_) => return Err(self.error("control character inside a string")),
                None => return Err(self.error("unexpected end of input inside a string")),
            }
        }
    }

    /// Decodes one escape (after the backslash) and writes it canonically.
    fn escape(&mut self) -> Result<(), HashError> {
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
    fn unicode_escape(&mut self, unit: u16) -> Result<(), HashError> {
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

    fn hex4(&mut self) -> Result<u16, HashError> {
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
    fn number(&mut self) -> Result<(), HashError> {
        let number_start = self.pos;
        let out_of_range = HashError::InvalidJson {
            offset: number_start,
            reason: "number exponent out of range",
        };
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
                    .ok_or_else(|| out_of_range.clone())?;
            }
            if exp_negative {
                exponent = -exponent;
            }
        }
        let input = self.input;
        let int_digits = &input[int_start..int_end];
        if self.pos == int_end && int_digits.len() <= 16 && !(negative && int_digits == b"0") {
            // A plain integer (no fraction, no exponent, not `-0`) is
            // canonical as written: a leading digit is never zero and at most
            // 15 trailing zeros fit.
            return Ok(());
        }
        // The number's text is not owed: its canonical form is written instead.
        self.flush_to(number_start);
        self.pending = self.pos;
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
            .ok_or(out_of_range)?;
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

/// The end of the run of string bytes starting at `pos` that need no
/// escaping (no `"`, `\\` or control character): sixteen bytes at a time
/// with SSE2 (part of every x86-64 CPU), then eight at a time.
/// (Also how the page decoder skips strings.)
#[inline]
pub(crate) fn plain_run_end(input: &[u8], pos: usize) -> usize {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    let pos = match plain_run_end_sse2(input, pos) {
        Ok(end) => return end,
        Err(pos) => pos,
    };
    plain_run_end_swar(input, pos)
}

/// [`plain_run_end`] over whole 16-byte blocks: `Ok` with the end when a
/// special byte is found, else `Err` with where the last partial block starts.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline]
fn plain_run_end_sse2(input: &[u8], mut pos: usize) -> Result<usize, usize> {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };
    while let Some((block, _)) = input
        .get(pos..)
        .and_then(|rest| rest.split_first_chunk::<16>())
    {
        // SAFETY: this function is only compiled with the sse2 target
        // feature (part of the x86-64 baseline), so these intrinsics are
        // available; the load is unaligned and reads exactly the 16 bytes of
        // `block`.
        #[allow(unsafe_code)]
        let hits = unsafe {
            let bytes = _mm_loadu_si128(block.as_ptr().cast::<__m128i>());
            let quote = _mm_cmpeq_epi8(bytes, _mm_set1_epi8(b'"' as i8));
            let backslash = _mm_cmpeq_epi8(bytes, _mm_set1_epi8(b'\\' as i8));
            // Unsigned `byte <= 0x1f`: the minimum with 0x1f is the byte itself.
            let control = _mm_cmpeq_epi8(_mm_min_epu8(bytes, _mm_set1_epi8(0x1f)), bytes);
            _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(quote, backslash), control))
        };
        if hits != 0 {
            return Ok(pos + hits.trailing_zeros() as usize);
        }
        pos += 16;
    }
    Err(pos)
}

/// [`plain_run_end`] eight bytes at a time (SWAR), then byte by byte.
#[inline]
fn plain_run_end_swar(input: &[u8], mut pos: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    while let Some((chunk, _)) = input
        .get(pos..)
        .and_then(|rest| rest.split_first_chunk::<8>())
    {
        let word = u64::from_le_bytes(*chunk);
        // Classic SWAR tests; each is exact for the lowest matching byte,
        // which is the only one used.
        let control = word.wrapping_sub(ONES * 0x20) & !word & HIGH;
        let quote = word ^ (ONES * u64::from(b'"'));
        let quote = quote.wrapping_sub(ONES) & !quote & HIGH;
        let backslash = word ^ (ONES * u64::from(b'\\'));
        let backslash = backslash.wrapping_sub(ONES) & !backslash & HIGH;
        let hits = control | quote | backslash;
        if hits != 0 {
            return pos + (hits.trailing_zeros() / 8) as usize;
        }
        pos += 8;
    }
    while let Some(&b) = input.get(pos) {
        if b == b'"' || b == b'\\' || b < 0x20 {
            break;
        }
        pos += 1;
    }
    pos
}

/// Writes an integer in decimal.
fn write_i64(out: &mut Vec<u8>, value: i64) {
    out.extend_from_slice(crate::json::signed_decimal(value, &mut [0; 20]).as_bytes());
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

#[cfg(test)]
#[cfg(test)]
mod tests {
    use super::super::{canonical_json, content_hash, ContentHash};
    use super::*;
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn hash(raw: &str) -> ContentHash {
        content_hash(raw, &IgnoreKeys::new(["updated_at"])).unwrap()
    }

    fn canonical(raw: &str) -> String {
        let mut out = Vec::new();
        canonical_json(raw, &IgnoreKeys::none(), &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    fn error(raw: &str) -> String {
        content_hash(raw, &IgnoreKeys::new(["updated_at"]))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn canonical_form_sorts_keys_drops_whitespace_and_normalises_numbers() {
        assert_eq!(
            canonical(" { \"b\" : 1 , \"a\" : [ 2.50 , { \"y\" : null , \"x\" : true } ] } "),
            r#"{"a":[25e-1,{"x":true,"y":null}],"b":1}"#
        );
        assert_eq!(
            canonical("[120, 1200000000000000000, 1e16, 0.001, -0.0]"),
            "[120,12e17,1e16,1e-3,0]"
        );
    }

    #[test]
    fn objects_out_of_order_at_every_level_are_written_in_key_order_once() {
        let ignore = IgnoreKeys::new(["updated_at"]);
        let raw = r#"{"z":{"d":[{"y":1,"x":{"q":2,"p":3}},{"a":0}],"c":{}},
            "updated_at":{"b":1,"a":{"d":1,"c":2}},"m":[{"k":1,"j":{"l":1,"i":2}}],
            "a":{"b":2,"b":1,"a":[{"c":1,"b":2}]}}"#;
        let expected = concat!(
            r#"{"a":{"a":[{"b":2,"c":1}],"b":2,"b":1},"m":[{"j":{"i":2,"l":1},"k":1}],"#,
            r#""z":{"c":{},"d":[{"x":{"p":3,"q":2},"y":1},{"a":0}]}}"#
        );
        for eager in [false, true] {
            let out = canonical_with(raw, &ignore, eager).unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), expected, "eager: {eager}");
        }
        // An object in order around objects out of order, and the reverse.
        let out = canonical_with(
            r#"[{"a":{"c":1,"b":2},"b":[{"e":1,"d":2}]},{"b":{"a":1},"a":2}]"#,
            &ignore,
            false,
        );
        assert_eq!(
            String::from_utf8(out.unwrap()).unwrap(),
            r#"[{"a":{"b":2,"c":1},"b":[{"d":2,"e":1}]},{"a":2,"b":{"a":1}}]"#
        );
    }

    #[test]
    fn keys_sharing_their_first_eight_bytes_are_ordered_by_the_key_alone() {
        // The eight-byte prefixes tie, so the reorder compares whole keys; a
        // key that is a prefix of another sorts first, whatever byte follows
        // (`!` sorts before the closing quote of the shorter key).
        assert_eq!(
            canonical(r#"{"abcdefgh!":1,"abcdefgh":2}"#),
            r#"{"abcdefgh":2,"abcdefgh!":1}"#
        );
        assert_eq!(
            canonical(r#"{"b":0,"abcdefgh":2,"abcdefgh!":1}"#),
            r#"{"abcdefgh":2,"abcdefgh!":1,"b":0}"#
        );
        assert_eq!(
            canonical(r#"{"abcdefghj":1,"abcdefghi":2,"abcdefgh":3}"#),
            r#"{"abcdefgh":3,"abcdefghi":2,"abcdefghj":1}"#
        );
    }

    #[test]
    fn scratch_buffers_are_kept_after_small_records_and_dropped_after_huge_ones() {
        let mut scratch = Scratch::default();
        let small = r#"{"b":[1,2],"a":"x"}"#;
        let len = canonicalize_then(&mut scratch, small, &IgnoreKeys::none(), |b| b.len());
        assert_eq!(len.unwrap(), small.len());
        assert!(scratch.out.capacity() > 0);
        assert!(scratch.resorted.capacity() > 0);
        assert!(scratch.members.capacity() > 0);
        assert!(scratch.sorted.capacity() > 0);
        assert!(scratch.objects.capacity() > 0);
        assert!(scratch.order.capacity() > 0);
        // Over 1 MiB of output in both orders, over 32 Ki members and objects.
        let members: Vec<String> = (0..120_000)
            .rev()
            .map(|i| format!("\"k{i}\":{{}}"))
            .collect();
        let objects: Vec<String> = (0..40_000).map(|_| "{\"a\":1}".to_string()).collect();
        let huge = format!("{{{},\"z\":[{}]}}", members.join(","), objects.join(","));
        let len = canonicalize_then(&mut scratch, &huge, &IgnoreKeys::none(), |b| b.len());
        assert_eq!(len.unwrap(), huge.len());
        assert_eq!(scratch.out.capacity(), 0);
        assert_eq!(scratch.resorted.capacity(), 0);
        assert_eq!(scratch.members.capacity(), 0);
        assert_eq!(scratch.sorted.capacity(), 0);
        assert_eq!(scratch.objects.capacity(), 0);
        assert_eq!(scratch.order.capacity(), 0);
    }

    #[test]
    fn equal_numbers_in_any_notation_hash_the_same() {
        let forms = [
            "25", "25.0", "25.00", "2.5e1", "2.5E+1", "250e-1", "0.25e2", "25000e-3",
        ];
        for form in forms {
            assert_eq!(
                hash(&format!("{{\"price\":{form}}}")),
                hash("{\"price\":25}"),
                "{form}"
            );
        }
        for zero in ["0", "-0", "0.0", "-0.000", "0e10", "0E-3"] {
            assert_eq!(hash(&format!("[{zero}]")), hash("[0]"), "{zero}");
        }
        assert_ne!(hash("[25]"), hash("[-25]"));
        assert_ne!(hash("[25]"), hash("[2.5]"));
        assert_ne!(hash("[25]"), hash("[\"25\"]"));
    }

    #[test]
    fn integers_beyond_two_to_the_53_stay_exact() {
        assert_ne!(hash("[9007199254740993]"), hash("[9007199254740992]"));
        assert_eq!(hash("[9007199254740993]"), hash("[9007199254740993.000]"));
        assert_ne!(
            hash("[123456789012345678901234567890]"),
            hash("[123456789012345678901234567891]")
        );
        assert_eq!(hash("[1e400]"), hash("[10e399]"));
    }

    #[test]
    fn strings_hash_by_value_whatever_their_escapes() {
        assert_eq!(hash(r#"["é"]"#), hash(r#"["\u00e9"]"#));
        assert_eq!(hash(r#"["é"]"#), hash(r#"["\u00E9"]"#));
        assert_eq!(hash(r#"["a/b"]"#), hash(r#"["a\/b"]"#));
        assert_eq!(hash(r#"["A\n"]"#), hash(r#"["\u0041\u000a"]"#));
        assert_eq!(hash(r#"["😀"]"#), hash(r#"["\ud83d\ude00"]"#));
        assert_eq!(canonical(r#"["\u001f\"\\\b"]"#), r#"["\u001f\"\\\b"]"#);
        // A lone surrogate stays a (canonical) escape, distinct from U+FFFD.
        assert_eq!(canonical(r#"["\uD800x"]"#), r#"["\ud800x"]"#);
        assert_ne!(hash(r#"["\ud800"]"#), hash("[\"\u{fffd}\"]"));
    }

    #[test]
    fn ignored_keys_are_dropped_at_any_depth_including_objects_in_arrays() {
        let a = r#"{"id":1,"updated_at":"2024-01-01T00:00:00Z","variants":[{"id":2,"updated_at":"x"}],"n":{"updated_at":1}}"#;
        let b = r#"{"id":1,"updated_at":"2025-06-01T00:00:00Z","variants":[{"id":2,"updated_at":null}],"n":{}}"#;
        assert_eq!(hash(a), hash(b));
        assert_ne!(
            content_hash(a, &IgnoreKeys::none()).unwrap(),
            content_hash(b, &IgnoreKeys::none()).unwrap()
        );
        let custom = IgnoreKeys::new(["rank", "updated_at"]);
        assert_eq!(
            content_hash(r#"{"a":1,"rank":5}"#, &custom).unwrap(),
            content_hash(r#"{"rank":7,"a":1}"#, &custom).unwrap()
        );
        // The key is matched by value, however it is escaped.
        assert_eq!(hash(r#"{"a":1,"updated\u005fat":5}"#), hash(r#"{"a":1}"#));
        // A string *value* equal to an ignored key name is kept.
        assert_ne!(hash(r#"["updated_at"]"#), hash("[]"));
    }

    /// Fixed outputs for the places where the lazy writer stops copying the
    /// input as it is (frozen, not compared with another writer of this file).
    #[test]
    fn where_the_input_stops_being_canonical_the_output_is_fixed() {
        let ignoring = |raw: &str| {
            let mut out = Vec::new();
            canonical_json(raw, &IgnoreKeys::new(["updated_at"]), &mut out).unwrap();
            String::from_utf8(out).unwrap()
        };
        let cases = [
            // Dropped members: first, consecutive, last, all, with objects inside.
            (r#"{"updated_at":1,"a":2,"updated_at":3,"b":4}"#, r#"{"a":2,"b":4}"#),
            (r#"{"updated_at":1,"updated_at":2,"c":3}"#, r#"{"c":3}"#),
            (r#"{"a":1,"updated_at":{"x":[1,{"y":2}]},"b":2}"#, r#"{"a":1,"b":2}"#),
            (r#"{"a":1,"updated_at":2}"#, r#"{"a":1}"#),
            (r#"{"updated_at":1,"updated_at":2}"#, "{}"),
            (r#"[{"updated_at":1},{"b":1,"updated_at":2,"a":3}]"#, r#"[{},{"a":3,"b":1}]"#),
            // An escaped key equal to an ignored one is dropped; an escaped value is rewritten.
            (r#"{"updated\u005fat":1,"a":"\u00e9\/"}"#, r#"{"a":"é/"}"#),
            // Numbers: written as they are only when plain integers.
            (
                "[-0,-0e0,5e0,-0.0,0.5,1234567890123456,12345678901234567,1000000000000000,10000000000000000,-7]",
                "[0,0,5,0,5e-1,1234567890123456,12345678901234567,1000000000000000,1e16,-7]",
            ),
            // Whitespace anywhere, and objects out of order at two levels.
            (
                " { \"b\" : [ 1 , { \"d\":1, \"c\":2 } ] ,\n\"a\" : true } ",
                r#"{"a":true,"b":[1,{"c":2,"d":1}]}"#,
            ),
            ("[ ]", "[]"),
            ("{ }", "{}"),
            (r#""top \n level""#, r#""top \n level""#),
        ];
        for (raw, expected) in cases {
            assert_eq!(ignoring(raw), expected, "canonical form of {raw}");
        }
        // At an offset, with text after the value left alone.
        let input = r#"xx {"b":1, "a":[2,3.0]} ,tail"#;
        let (bytes, head) =
            with_canonical_at(input, 2, &IgnoreKeys::none(), |b| b.to_vec()).unwrap();
        assert_eq!(bytes, br#"{"a":[2,3],"b":1}"#);
        assert_eq!(&input[head.end..], " ,tail");
    }

    #[test]
    fn dropping_the_first_member_leaves_valid_canonical_json() {
        let mut out = Vec::new();
        canonical_json(
            r#"{"updated_at":1,"b":2,"a":1}"#,
            &IgnoreKeys::new(["updated_at"]),
            &mut out,
        )
        .unwrap();
        assert_eq!(out, br#"{"a":1,"b":2}"#);
        canonical_json(
            r#"{"updated_at":1}"#,
            &IgnoreKeys::new(["updated_at"]),
            &mut out,
        )
        .unwrap();
        assert_eq!(out, b"{}");
    }

    #[test]
    fn invalid_json_is_reported_with_the_byte_offset_and_cause() {
        assert_eq!(
            error(r#"{"a":}"#),
            "invalid json at byte 5: expected a json value"
        );
        assert_eq!(
            error(r#"{"a" 1}"#),
            "invalid json at byte 5: expected ':' after object key"
        );
        assert_eq!(
            error("[1,2"),
            "invalid json at byte 4: unexpected end of input inside an array"
        );
        assert_eq!(
            error("[01]"),
            "invalid json at byte 2: leading zero in number"
        );
        assert_eq!(
            error("[1.]"),
            "invalid json at byte 3: expected a digit after the decimal point"
        );
        assert_eq!(
            error("[1e]"),
            "invalid json at byte 3: expected a digit in the exponent"
        );
        assert_eq!(
            error("{} x"),
            "invalid json at byte 3: trailing characters after the json value"
        );
        assert_eq!(
            error("[tru]"),
            "invalid json at byte 1: invalid literal, expected true, false or null"
        );
        assert_eq!(
            error("\"a\nb\""),
            "invalid json at byte 2: control character inside a string"
        );
        assert_eq!(
            error(r#"["\x"]"#),
            "invalid json at byte 3: invalid escape in string"
        );
        assert_eq!(
            error(r#"["\u12"]"#),
            "invalid json at byte 4: invalid hex digit in \\u escape"
        );
        assert_eq!(
            error("{1:2}"),
            "invalid json at byte 1: expected a string key in object"
        );
        assert_eq!(
            error(""),
            "invalid json at byte 0: unexpected end of input, expected a json value"
        );
        assert_eq!(
            error("[1e99999999999999999999]"),
            "invalid json at byte 1: number exponent out of range"
        );
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert_eq!(
            error(&deep),
            "invalid json at byte 128: nesting deeper than 128 levels"
        );
    }

    #[test]
    fn exactly_128_levels_of_arrays_or_objects_are_accepted() {
        let arrays = "[".repeat(128) + &"]".repeat(128);
        assert_eq!(canonical(&arrays), arrays);
        let objects = r#"{"a":"#.repeat(128) + "1" + &"}".repeat(128);
        assert_eq!(canonical(&objects), objects);
        let too_deep = r#"{"a":"#.repeat(129) + "1" + &"}".repeat(129);
        assert_eq!(
            error(&too_deep),
            "invalid json at byte 640: nesting deeper than 128 levels"
        );
    }

    #[test]
    fn canonical_json_agrees_with_serde_json_on_a_voucher_record() {
        let raw = r#"{"id":7,"slug":"spa-day","title":"Spa \u0044ay","price":25.00,"sale_price":null,
            "image_urls":["https:\/\/x\/1.jpg"],"category_refs":[{"id":3,"slug":"s","title":"T","sort_order":1}],
            "variant_summaries":[],"is_monetary":false,"updated_at":"2024-05-01T10:00:00Z"}"#;
        let mut out = Vec::new();
        canonical_json(raw, &IgnoreKeys::none(), &mut out).unwrap();
        let ours: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let theirs: serde_json::Value = serde_json::from_str(raw).unwrap();
        // Same document except the number notation of the price.
        assert_eq!(ours["title"], theirs["title"]);
        assert_eq!(ours["image_urls"], theirs["image_urls"]);
        assert_eq!(ours["category_refs"], theirs["category_refs"]);
        assert_eq!(ours["price"].as_f64(), theirs["price"].as_f64());
    }

    #[test]
    fn the_word_at_a_time_string_scan_stops_at_the_first_special_byte() {
        let text = "abcdefghijklmnopqrstuvwxyzé€😀";
        for special in ["\"", "\\", "\n", "\u{1f}", "\u{0}"] {
            for at in 0..=text.len() {
                if !text.is_char_boundary(at) {
                    continue;
                }
                let input = format!("{}{special}{}", &text[..at], &text[at..]);
                assert_eq!(plain_run_end(input.as_bytes(), 0), at, "{input:?}");
                assert_eq!(plain_run_end(input.as_bytes(), at.min(3)), at, "{input:?}");
            }
        }
        assert_eq!(plain_run_end(text.as_bytes(), 0), text.len());
    }

    proptest! {
        #[test]
        fn the_block_scans_stop_where_a_byte_by_byte_scan_stops(
            bytes in proptest::collection::vec(
                prop_oneof![
                    40 => 0x20u8..=0xff,
                    1 => Just(b'"'),
                    1 => Just(b'\\'),
                    1 => 0u8..0x20,
                ],
                0..80,
            ),
            start in 0usize..80,
        ) {
            let start = start.min(bytes.len());
            let expected = bytes[start..]
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                .map_or(bytes.len(), |at| start + at);
            prop_assert_eq!(plain_run_end(&bytes, start), expected);
            prop_assert_eq!(plain_run_end_swar(&bytes, start), expected);
        }
    }

    // ---- properties -------------------------------------------------------

    /// A JSON value model; numbers are `(negative, mantissa, exponent)`.
    #[derive(Debug, Clone)]
    enum J {
        Null,
        Bool(bool),
        Num(bool, u64, i32),
        Str(String),
        Arr(Vec<J>),
        Obj(Vec<(String, J)>),
    }

    fn key_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z_]{1,8}",
            any::<String>().prop_map(|s| s.chars().take(6).collect()),
        ]
        .prop_filter("not an ignored key", |k| k != "updated_at")
    }

    fn json_strategy() -> impl Strategy<Value = J> {
        let leaf = prop_oneof![
            Just(J::Null),
            any::<bool>().prop_map(J::Bool),
            (any::<bool>(), any::<u64>(), -30i32..30).prop_map(|(n, m, e)| J::Num(n, m, e)),
            (any::<bool>(), 0u64..1000, 0i32..3).prop_map(|(n, m, e)| J::Num(n, m, e)),
            any::<String>().prop_map(J::Str),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(J::Arr),
                prop::collection::vec((key_strategy(), inner), 0..6).prop_map(|members| {
                    let mut seen = std::collections::HashSet::new();
                    J::Obj(
                        members
                            .into_iter()
                            .filter(|(k, _)| seen.insert(k.clone()))
                            .collect(),
                    )
                }),
            ]
        })
    }

    /// Like [`json_strategy`], with duplicate keys and ignored keys (whose
    /// values may be objects and arrays) allowed.
    fn loose_json_strategy() -> impl Strategy<Value = J> {
        let leaf = prop_oneof![
            Just(J::Null),
            (any::<bool>(), 0u64..1000, -3i32..3).prop_map(|(n, m, e)| J::Num(n, m, e)),
            "[a-c\\\\\"é]{0,3}".prop_map(J::Str),
        ];
        let key = prop_oneof![
            "[ab]{1,2}",
            Just("updated_at".to_string()),
            "[a-c\\\\\"é\n]{0,9}",
        ];
        leaf.prop_recursive(5, 64, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(J::Arr),
                prop::collection::vec((key.clone(), inner), 0..7).prop_map(J::Obj),
            ]
        })
    }

    #[test]
    fn a_remembered_shape_keeps_a_repeated_key_in_input_order() {
        // The first record leaves the order of two different keys that share
        // their first eight bytes; the second has one of them twice there.
        let mut warm = Scratch::default();
        let ignore = IgnoreKeys::none();
        for text in [
            r#"{"z":0,"image_urls":1,"image_url":2}"#,
            r#"{"z":0,"image_url":1,"image_url":2}"#,
        ] {
            let (reused, fresh) = warm_and_fresh(&mut warm, text, &ignore);
            assert_eq!(reused, fresh);
        }
        let out = canonicalize_then(
            &mut warm,
            r#"{"z":0,"image_url":1,"image_url":2}"#,
            &ignore,
            <[u8]>::to_vec,
        )
        .unwrap();
        assert_eq!(out, br#"{"image_url":1,"image_url":2,"z":0}"#);
    }

    /// The canonical form of `text` written with `warm` (its remembered
    /// shapes reused) and with a fresh scratch sorting each object in place.
    fn warm_and_fresh(warm: &mut Scratch, text: &str, ignore: &IgnoreKeys) -> (String, String) {
        let reused = canonicalize_then(warm, text, ignore, <[u8]>::to_vec).unwrap();
        let fresh = canonical_with(text, ignore, true).unwrap();
        (
            String::from_utf8(reused).unwrap(),
            String::from_utf8(fresh).unwrap(),
        )
    }

    /// Keys for records of few shapes: short ones, long ones whose first
    /// eight bytes are the same (prefix ties) or differ only past the eighth
    /// byte in different records, and a repeated key.
    const SHAPE_KEYS: [&str; 10] = [
        "id",
        "slug",
        "price",
        "abcdefgh_one",
        "abcdefgh_two",
        "abcdefgX",
        "variant_summaries",
        "variant_sum",
        "updated_at",
        "id",
    ];

    /// A record of the keys `members` picks from [`SHAPE_KEYS`], in that
    /// order, each with a small object, a string or a number as its value.
    fn shape_record(members: &[(usize, u8)]) -> String {
        let mut text = String::from("{");
        for (i, &(key, value)) in members.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            let value = match value {
                0 => format!("{{\"z\":{i},\"a\":{key}}}"),
                1 => format!("\"v{i}\""),
                _ => format!("{i}.50"),
            };
            text.push_str(&format!("\"{}\":{value}", SHAPE_KEYS[key]));
        }
        text.push('}');
        text
    }

    /// The canonical form written by this version (`eager` false) or by
    /// sorting each object in place as it closes (`eager` true).
    fn canonical_with(raw: &str, ignore: &IgnoreKeys, eager: bool) -> Result<Vec<u8>, HashError> {
        let mut scratch = Scratch {
            eager,
            ..Scratch::default()
        };
        canonicalize_then(&mut scratch, raw, ignore, <[u8]>::to_vec)
    }

    /// Renders `j` as JSON; with `rng`, varies key order, number notation,
    /// string escapes and whitespace, and adds ignored keys.
    fn render(j: &J, rng: &mut Option<StdRng>, out: &mut String) {
        let ws = |rng: &mut Option<StdRng>, out: &mut String| {
            if let Some(r) = rng {
                for _ in 0..r.random_range(0..3) {
                    out.push([' ', '\n', '\t', '\r'][r.random_range(0..4)]);
                }
            }
        };
        ws(rng, out);
        match j {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Num(neg, m, e) => render_number(*neg, *m, *e, rng, out),
            J::Str(s) => render_string(s, rng, out),
            J::Arr(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    render(item, rng, out);
                }
                out.push(']');
            }
            J::Obj(members) => {
                let mut members: Vec<(String, J)> = members.clone();
                if let Some(r) = rng {
                    for i in (1..members.len()).rev() {
                        members.swap(i, r.random_range(0..=i));
                    }
                    if r.random_bool(0.3) {
                        let at = r.random_range(0..=members.len());
                        members.insert(at, ("updated_at".into(), J::Num(false, r.random(), 0)));
                    }
                }
                out.push('{');
                for (i, (k, v)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    render_string(k, rng, out);
                    ws(rng, out);
                    out.push(':');
                    render(v, rng, out);
                }
                out.push('}');
            }
        }
        ws(rng, out);
    }

    fn render_number(neg: bool, m: u64, e: i32, rng: &mut Option<StdRng>, out: &mut String) {
        let Some(r) = rng else {
            out.push_str(&format!("{}{m}e{e}", if neg { "-" } else { "" }));
            return;
        };
        // value = m * 10^e; pad the mantissa with zeros, then place the point.
        let pad = r.random_range(0..4usize);
        let digits = format!("{m}{}", "0".repeat(pad));
        let exp = i64::from(e) - pad as i64;
        let point = r.random_range(0..=digits.len());
        let (int, frac) = digits.split_at(point);
        let int = int.trim_start_matches('0');
        let shown_exp = exp + frac.len() as i64;
        if neg {
            out.push('-');
        }
        out.push_str(if int.is_empty() { "0" } else { int });
        if !frac.is_empty() {
            out.push('.');
            out.push_str(frac);
        }
        if shown_exp != 0 || r.random_bool(0.2) {
            out.push(if r.random_bool(0.5) { 'e' } else { 'E' });
            if shown_exp >= 0 && r.random_bool(0.5) {
                out.push('+');
            }
            out.push_str(&shown_exp.to_string());
        }
    }

    fn render_string(s: &str, rng: &mut Option<StdRng>, out: &mut String) {
        out.push('"');
        for ch in s.chars() {
            let must_escape = ch == '"' || ch == '\\' || (ch as u32) < 0x20;
            let escape = must_escape || rng.as_mut().is_some_and(|r| r.random_bool(0.2));
            if !escape {
                out.push(ch);
                continue;
            }
            let short = match ch {
                '"' => Some("\\\""),
                '\\' => Some("\\\\"),
                '/' => Some("\\/"),
                '\n' => Some("\\n"),
                '\t' => Some("\\t"),
                '\r' => Some("\\r"),
                '\u{8}' => Some("\\b"),
                '\u{c}' => Some("\\f"),
                _ => None,
            };
            let use_short = short.is_some() && rng.as_mut().is_none_or(|r| r.random_bool(0.5));
            match short {
                Some(text) if use_short => out.push_str(text),
                _ => {
                    let upper = rng.as_mut().is_some_and(|r| r.random_bool(0.5));
                    let mut units = [0u16; 2];
                    for unit in ch.encode_utf16(&mut units) {
                        if upper {
                            out.push_str(&format!("\\u{unit:04X}"));
                        } else {
                            out.push_str(&format!("\\u{unit:04x}"));
                        }
                    }
                }
            }
        }
        out.push('"');
    }

    fn plain(j: &J) -> String {
        let mut out = String::new();
        render(j, &mut None, &mut out);
        out
    }

    fn noisy(j: &J, seed: u64) -> String {
        let mut out = String::new();
        render(j, &mut Some(StdRng::seed_from_u64(seed)), &mut out);
        out
    }

    /// Changes exactly one non-ignored value somewhere in `j`.
    fn mutate(j: &J, rng: &mut StdRng) -> J {
        match j {
            J::Arr(items) if !items.is_empty() && rng.random_bool(0.7) => {
                let mut items = items.clone();
                let i = rng.random_range(0..items.len());
                items[i] = mutate(&items[i], rng);
                J::Arr(items)
            }
            J::Obj(members) if !members.is_empty() && rng.random_bool(0.7) => {
                let mut members = members.clone();
                let i = rng.random_range(0..members.len());
                if rng.random_bool(0.8) {
                    members[i].1 = mutate(&members[i].1, rng);
                } else {
                    // Rename the key to one not present.
                    let mut name = format!("{}~", members[i].0);
                    while members.iter().any(|(k, _)| *k == name) {
                        name.push('~');
                    }
                    members[i].0 = name;
                }
                J::Obj(members)
            }
            J::Arr(items) => {
                let mut items = items.clone();
                items.push(J::Null);
                J::Arr(items)
            }
            J::Obj(members) => {
                let mut members = members.clone();
                let mut name = "new".to_string();
                while members.iter().any(|(k, _)| *k == name) {
                    name.push('~');
                }
                members.push((name, J::Null));
                J::Obj(members)
            }
            J::Null => J::Bool(false),
            J::Bool(b) => J::Bool(!b),
            J::Num(neg, m, e) if *m == 0 => J::Num(*neg, 1, *e),
            J::Num(neg, m, e) => match rng.random_range(0..3) {
                0 => J::Num(!neg, *m, *e),
                1 => J::Num(*neg, m.wrapping_add(1).max(1), *e),
                _ => J::Num(*neg, *m, e + 1),
            },
            J::Str(s) => J::Str(format!("{s}x")),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn key_order_number_notation_escapes_whitespace_and_ignored_keys_never_change_the_hash(
            j in json_strategy(), seed in any::<u64>()
        ) {
            let a = plain(&j);
            let b = noisy(&j, seed);
            prop_assert_eq!(hash(&a), hash(&b), "{} vs {}", a, b);
        }

        #[test]
        fn any_change_to_a_non_ignored_value_changes_the_hash(
            j in json_strategy(), seed in any::<u64>()
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            let changed = mutate(&j, &mut rng);
            let a = plain(&j);
            let b = noisy(&changed, seed);
            prop_assert_ne!(hash(&a), hash(&b), "{} vs {}", a, b);
        }

        #[test]
        fn canonical_output_is_valid_json_that_serde_json_reads(j in json_strategy(), seed in any::<u64>()) {
            let mut out = Vec::new();
            canonical_json(&noisy(&j, seed), &IgnoreKeys::none(), &mut out).unwrap();
            prop_assert!(serde_json::from_slice::<serde_json::Value>(&out).is_ok(), "{}", String::from_utf8_lossy(&out));
        }

        #[test]
        fn writing_objects_once_in_key_order_gives_the_bytes_of_sorting_each_in_place(
            j in loose_json_strategy(), seed in any::<u64>()
        ) {
            let text = noisy(&j, seed);
            let ignore = IgnoreKeys::new(["updated_at", "b"]);
            let once = canonical_with(&text, &ignore, false).unwrap();
            let in_place = canonical_with(&text, &ignore, true).unwrap();
            prop_assert_eq!(
                String::from_utf8_lossy(&once),
                String::from_utf8_lossy(&in_place),
                "{}",
                text
            );
        }

        #[test]
        fn objects_sorted_by_a_remembered_shape_get_the_bytes_of_a_fresh_sort(
            shapes in prop::collection::vec(
                prop::collection::vec(0usize..SHAPE_KEYS.len(), 0..12),
                1..4,
            ),
            picks in prop::collection::vec(
                (any::<prop::sample::Index>(), 0usize..12, 0usize..12, any::<bool>(), 0u8..3),
                1..40,
            ),
        ) {
            // Records of a few shapes, some with two keys swapped or one key
            // written over another (both keep the prefix sequence when the
            // two keys share their prefix).
            let records: Vec<Vec<(usize, u8)>> = picks
                .iter()
                .map(|(shape, a, b, swap, value)| {
                    let mut keys = shapes[shape.index(shapes.len())].clone();
                    if *a < keys.len() && *b < keys.len() {
                        if *swap {
                            keys.swap(*a, *b);
                        } else {
                            keys[*b] = keys[*a];
                        }
                    }
                    keys.into_iter().map(|key| (key, *value)).collect()
                })
                .collect();
            // One scratch for every record, as a listing's thread has: the
            // shapes sorted by earlier records are reused by later ones.
            let mut warm = Scratch::default();
            let ignore = IgnoreKeys::new(["updated_at"]);
            for members in &records {
                let text = shape_record(members);
                let (reused, fresh) = warm_and_fresh(&mut warm, &text, &ignore);
                prop_assert_eq!(reused, fresh, "{}", text);
            }
        }

        #[test]
        fn arbitrary_text_never_panics(text in any::<String>()) {
            let _ = content_hash(&text, &IgnoreKeys::new(["updated_at"]));
        }
    }
}
