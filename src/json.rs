//! Small scans of JSON text that is valid (or whose validity something else
//! checks): where whitespace, a string or a value ends. Used where a whole
//! parse is not needed: the page decoder (a record's `id` and
//! `updated_at`, the envelope around the records) and the sinks' reading of
//! an event's routing attributes. Also the decimal digits of an integer,
//! which events and the canonical form write without `format!`.

/// The first position at or after `pos` that is not JSON whitespace.
pub(crate) fn skip_ws(bytes: &[u8], mut pos: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\r' | b'\t') = bytes.get(pos) {
        pos += 1;
    }
    pos
}

/// The end (one past the closing quote) of the string opening at `start`.
fn string_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut pos = start + 1;
    loop {
        // Eight bytes at a time up to the next quote, backslash (or control
        // character, which valid JSON strings do not hold).
        pos = crate::hash::plain_run_end(bytes, pos);
        match bytes.get(pos)? {
            b'"' => return Some(pos + 1),
            b'\\' => pos += 2,
            _ => pos += 1,
        }
    }
}

/// The end of the (valid) JSON value starting at `start`.
pub(crate) fn value_end(bytes: &[u8], start: usize) -> Option<usize> {
    match bytes.get(start)? {
        b'"' => string_end(bytes, start),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut pos = start;
            loop {
                match bytes.get(pos)? {
                    b'"' => {
                        pos = string_end(bytes, pos)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(pos + 1);
                        }
                    }
                    _ => {}
                }
                pos += 1;
            }
        }
        _ => {
            let mut pos = start;
            while let Some(b) = bytes.get(pos) {
                if matches!(b, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t') {
                    break;
                }
                pos += 1;
            }
            Some(pos)
        }
    }
}

/// What the visitor of [`walk_object`] did with a member's value.
pub(crate) enum Visited {
    /// Read or skipped it; it ends at this position.
    Until(usize),
    /// Wants no more members: the walk ends at the value's start.
    Stop,
}

/// Walks the members of the object starting at `start`: calls `visit` with
/// each key (the bytes between its quotes) and the position where its value
/// starts, and returns where the walk ended (one past the closing brace, or
/// the value at which `visit` stopped). None when the text is not an object
/// of plain members (a key written with an escape included) or `visit`
/// returns None.
pub(crate) fn walk_object(
    bytes: &[u8],
    start: usize,
    mut visit: impl FnMut(&[u8], usize) -> Option<Visited>,
) -> Option<usize> {
    if bytes.get(start) != Some(&b'{') {
        return None;
    }
    let mut pos = skip_ws(bytes, start + 1);
    if bytes.get(pos) == Some(&b'}') {
        return Some(pos + 1);
    }
    loop {
        if bytes.get(pos) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(bytes, pos)?;
        let key = &bytes[pos + 1..key_end - 1];
        if key.contains(&b'\\') {
            return None;
        }
        pos = skip_ws(bytes, key_end);
        if bytes.get(pos) != Some(&b':') {
            return None;
        }
        pos = skip_ws(bytes, pos + 1);
        match visit(key, pos)? {
            Visited::Until(end) => pos = skip_ws(bytes, end),
            Visited::Stop => return Some(pos),
        }
        match bytes.get(pos) {
            Some(b',') => pos = skip_ws(bytes, pos + 1),
            Some(b'}') => return Some(pos + 1),
            _ => return None,
        }
    }
}

/// The decimal digits of `n`, written into the end of `buf`: every event and
/// every canonical integer writes numbers, and `format!` costs several times
/// more than the digits.
pub(crate) fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &str {
    let mut start = buf.len();
    loop {
        start -= 1;
        buf[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    digits(buf, start)
}

/// `n` in decimal with its sign, written into the end of `buf` (20 bytes
/// hold `i64::MIN`): a record id in an event, an integer in the canonical form.
pub(crate) fn signed_decimal(n: i64, buf: &mut [u8; 20]) -> &str {
    let start = buf.len() - decimal(n.unsigned_abs(), buf).len();
    if n >= 0 {
        return digits(buf, start);
    }
    buf[start - 1] = b'-';
    digits(buf, start - 1)
}

/// `buf[start..]`, ASCII digits and sign written above (never fails).
fn digits(buf: &[u8; 20], start: usize) -> &str {
    std::str::from_utf8(&buf[start..]).unwrap_or_default()
}
