//! Text a store sent (an error body, a message quoting one) made safe to
//! show: every allowed uid reads the broker's log and `stats`, and a
//! hostile or careless store can answer with megabytes, with forged log
//! lines, or with the request's own headers echoed back (the session
//! token and access key id among them). So store text is
//!
//! * stripped of the broker's credentials: each value of the variables
//!   the stores' clients read them from, wherever it appears;
//! * stripped of anything credential-shaped: the rest of a line after
//!   `Authorization`, `X-Amz-Security-Token`, `Signature=` and the like,
//!   and AWS access key ids (`AKIA…`, `ASIA…`) of other keys;
//! * one line (control characters become spaces), at most [`MAX_CHARS`]
//!   characters, the cut said.

use std::sync::OnceLock;

/// The longest store text kept, in characters.
pub(crate) const MAX_CHARS: usize = 300;

/// Where the stores' clients (`object_store`'s builders `from_env`) take
/// credentials from: their values never reach a message.
const SECRET_VARS: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_MASTER_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_TOKEN",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_CLIENT_SECRET",
];

/// Keys after which the rest of a line is a credential (lower case).
const SECRET_KEYS: &[&str] = &[
    "authorization",
    "x-amz-security-token",
    "x-amz-credential",
    "x-amz-signature",
    "signature=",
    "credential=",
    "sig=",
    "x-ms-sas",
    "sharedkey",
    "bearer ",
    "awsaccesskeyid",
    "securitytoken",
    "sessiontoken",
    "secretaccesskey",
    "accountkey",
];

const REDACTED: &str = "[redacted]";

fn env_secrets() -> &'static [String] {
    static SECRETS: OnceLock<Vec<String>> = OnceLock::new();
    SECRETS.get_or_init(|| {
        SECRET_VARS
            .iter()
            .filter_map(|v| std::env::var(v).ok())
            // A value this short would blank ordinary words.
            .filter(|v| v.len() >= 6)
            .collect()
    })
}

/// `text` (from a store) safe to show: see the module's doc.
pub(crate) fn store_text(text: &str) -> String {
    bounded(&redact(text, env_secrets()))
}

/// `text` with each of `secrets` and anything credential-shaped replaced.
pub(crate) fn redact(text: &str, secrets: &[String]) -> String {
    let mut t = text.to_string();
    for s in secrets {
        if t.contains(s.as_str()) {
            t = t.replace(s.as_str(), REDACTED);
        }
    }
    let mut out = String::with_capacity(t.len());
    for (i, line) in t.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&redact_line(line));
    }
    redact_key_ids(&out)
}

/// The line up to its first credential key, then [`REDACTED`].
fn redact_line(line: &str) -> String {
    let lower = line.to_ascii_lowercase();
    match SECRET_KEYS.iter().filter_map(|k| lower.find(k)).min() {
        // ASCII lowering keeps byte offsets: `at` is a boundary in `line`.
        Some(at) => format!("{}{REDACTED}", &line[..at]),
        None => line.to_string(),
    }
}

/// AWS access key ids (`AKIA`/`ASIA`/… and 16 upper-case letters or
/// digits) replaced: another key's id is still not for other users.
fn redact_key_ids(text: &str) -> String {
    const PREFIXES: [&str; 5] = ["AKIA", "ASIA", "AIDA", "AROA", "ANPA"];
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let mut copied = 0;
    while i + 20 <= b.len() {
        let id_like = PREFIXES.iter().any(|p| b[i..].starts_with(p.as_bytes()))
            && b[i + 4..i + 20]
                .iter()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
            && (i == 0 || !b[i - 1].is_ascii_alphanumeric());
        if id_like {
            out.push_str(&text[copied..i]);
            out.push_str(REDACTED);
            i += 20;
            copied = i;
        } else {
            i += 1;
        }
    }
    out.push_str(&text[copied..]);
    out
}

/// One line of at most [`MAX_CHARS`] characters, the cut said.
fn bounded(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_CHARS + 40));
    for (chars, (at, c)) in text.char_indices().enumerate() {
        if chars == MAX_CHARS {
            out.push_str(&format!("… ({} more bytes)", text.len() - at));
            return out;
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_credential_shaped_text_are_replaced() {
        let secrets = vec!["sessiontoken-value-123".to_string(), "AKIDTESTKEY".into()];
        let echoed = "403 Forbidden: <Error><Code>AccessDenied</Code></Error>\n\
             host: 127.0.0.1\n\
             x-amz-security-token: sessiontoken-value-123\n\
             authorization: AWS4-HMAC-SHA256 Credential=AKIDTESTKEY/20261126/us-east-1/s3\n\
             other id AKIAABCDEFGHIJKLMNOP here\n\
             and the token again: sessiontoken-value-123";
        let r = redact(echoed, &secrets);
        assert!(!r.contains("sessiontoken-value-123"), "{r}");
        assert!(!r.contains("AKIDTESTKEY"), "{r}");
        assert!(!r.contains("AKIAABCDEFGHIJKLMNOP"), "{r}");
        assert!(!r.contains("AWS4-HMAC"), "{r}");
        // What is not a credential stays readable.
        assert!(
            r.contains("AccessDenied") && r.contains("host: 127.0.0.1"),
            "{r}"
        );
        assert!(r.contains("other id [redacted] here"), "{r}");
    }

    #[test]
    fn store_text_is_one_bounded_line() {
        let big = format!("first\nforged: line\r\n{}", "x".repeat(2 << 20));
        let t = bounded(&big);
        assert!(!t.contains('\n') && !t.contains('\r'), "{t}");
        assert!(t.chars().count() < MAX_CHARS + 40, "{}", t.len());
        assert!(t.starts_with("first forged: line"), "{t}");
        assert!(
            t.ends_with(&format!("({} more bytes)", big.len() - MAX_CHARS)),
            "{t}"
        );
        assert_eq!(bounded("short"), "short");
        // Multi-byte characters are cut on a boundary.
        let wide = "é".repeat(MAX_CHARS * 2);
        assert!(bounded(&wide).starts_with(&"é".repeat(MAX_CHARS)));
    }
}
