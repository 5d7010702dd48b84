//! A strict parser of the Prometheus text format and a scrape of `/metrics`,
//! for the tests that check what the daemon exports.

use std::collections::BTreeMap;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (with `_bucket`, `_count`, ... suffixes).
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

/// Parses the Prometheus text exposition format (0.0.4), strictly.
pub fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    let mut samples = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let at = |what: &str| format!("line {}: {what}: {line}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let words: Vec<&str> = comment.split_whitespace().collect();
            match words.first() {
                Some(&"HELP") if words.len() >= 2 && valid_name(words[1]) => {}
                Some(&"TYPE")
                    if words.len() == 3
                        && valid_name(words[1])
                        && ["counter", "gauge", "histogram", "summary", "untyped"]
                            .contains(&words[2]) => {}
                _ => return Err(at("malformed comment")),
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value"))?;
        let name = &line[..name_end];
        if !valid_name(name) {
            return Err(at("invalid metric name"));
        }
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(after) = rest.strip_prefix('{') {
            let mut chars = after.char_indices().peekable();
            loop {
                let Some(&(i, c)) = chars.peek() else {
                    return Err(at("unterminated labels"));
                };
                if c == '}' {
                    rest = &after[i + 1..];
                    break;
                }
                let key_start = i;
                while let Some(&(_, c)) = chars.peek() {
                    if c == '=' {
                        break;
                    }
                    chars.next();
                }
                let Some((eq, _)) = chars.next() else {
                    return Err(at("label without ="));
                };
                let key = &after[key_start..eq];
                if !valid_name(key) || key.contains(':') {
                    return Err(at("invalid label name"));
                }
                if chars.next().map(|(_, c)| c) != Some('"') {
                    return Err(at("label value not quoted"));
                }
                let mut value = String::new();
                loop {
                    match chars.next() {
                        Some((_, '\\')) => match chars.next() {
                            Some((_, 'n')) => value.push('\n'),
                            Some((_, '\\')) => value.push('\\'),
                            Some((_, '"')) => value.push('"'),
                            _ => return Err(at("bad escape in label value")),
                        },
                        Some((_, '"')) => break,
                        Some((_, c)) => value.push(c),
                        None => return Err(at("unterminated label value")),
                    }
                }
                labels.insert(key.to_string(), value);
                if let Some(&(_, ',')) = chars.peek() {
                    chars.next();
                }
            }
        }
        let mut fields = rest.split_whitespace();
        let raw = fields.next().ok_or_else(|| at("no value"))?;
        let value = match raw {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            other => other.parse().map_err(|_| at("value is not a number"))?,
        };
        if let Some(ts) = fields.next() {
            ts.parse::<i64>().map_err(|_| at("bad timestamp"))?;
        }
        if fields.next().is_some() {
            return Err(at("trailing text"));
        }
        samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    Ok(samples)
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// The sum of the samples of `name` whose labels include `filter`.
pub fn sum(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            filter
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// `GET {admin}/metrics`, checked to be Prometheus text, parsed.
pub async fn scrape(admin: &str) -> Vec<Sample> {
    let response = reqwest::get(format!("{admin}/metrics")).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let text = response.text().await.unwrap();
    parse_prometheus(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}
