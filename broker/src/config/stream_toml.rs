//! TOML for a broker's streams, the other way round from the parser
//! above: the demo, the benchmarks and the tests configure their brokers
//! with [`StreamToml`] rather than each spelling the TOML.

use std::path::Path;

/// Writes a `[[stream]]` table: the demo, the benchmarks and the tests
/// configure their brokers with it rather than each spelling the TOML.
///
/// ```
/// use batchcast_broker::config::StreamToml;
/// let text = StreamToml::synthetic("train", 8, 100, &[("x", "f32", &[3])])
///     .epochs(2)
///     .key("slots", 4)
///     .to_toml();
/// assert!(text.contains("epochs = 2") && text.contains("slots = 4"));
/// ```
#[derive(Debug, Clone)]
pub struct StreamToml {
    /// The `[[stream]]` table's keys, one `key = value` per line, in order.
    lines: Vec<String>,
    /// The tables after it: the source, and an image stream's transform.
    tables: String,
}

impl StreamToml {
    /// A synthetic stream of `len` samples in batches of `batch_size`;
    /// `fields` are `(name, dtype, shape)`.
    pub fn synthetic(
        name: &str,
        batch_size: u64,
        len: u64,
        fields: &[(&str, &str, &[u64])],
    ) -> StreamToml {
        let fields: Vec<String> = fields
            .iter()
            .map(|(n, d, s)| format!("  {{ name = \"{n}\", dtype = \"{d}\", shape = {s:?} }},"))
            .collect();
        StreamToml {
            lines: vec![
                format!("name = \"{name}\""),
                format!("batch_size = {batch_size}"),
            ],
            tables: format!(
                "[stream.synthetic]\nlen = {len}\nfields = [\n{}\n]\n",
                fields.join("\n")
            ),
        }
    }

    /// An image training stream over the ImageFolder at `root`:
    /// RandomResizedCrop(`size`) + flip + ImageNet Normalize, f32 NCHW.
    pub fn image_folder(name: &str, batch_size: u64, root: &Path, size: u32) -> StreamToml {
        StreamToml {
            lines: vec![
                format!("name = \"{name}\""),
                format!("batch_size = {batch_size}"),
            ],
            tables: format!(
                r#"[stream.image_folder]
root = "{}"

[stream.transform]
random_resized_crop = {{ size = {size} }}
horizontal_flip = 0.5
normalize = {{ mean = [0.485, 0.456, 0.406], std = [0.229, 0.224, 0.225] }}
dtype = "f32"
"#,
                root.display()
            ),
        }
    }

    /// A synthetic stream's `fill` (`"full"` or `"stamp"`).
    pub fn fill(mut self, fill: &str) -> StreamToml {
        self.tables = self.tables.replacen(
            "[stream.synthetic]\n",
            &format!("[stream.synthetic]\nfill = \"{fill}\"\n"),
            1,
        );
        self
    }

    /// `epochs = n`.
    pub fn epochs(self, n: u64) -> StreamToml {
        self.key("epochs", n)
    }

    /// Any other key of the `[[stream]]` table, its value written as TOML
    /// writes a number or a boolean (strings: [`StreamToml::raw`]).
    pub fn key(mut self, key: &str, value: impl std::fmt::Display) -> StreamToml {
        self.lines.push(format!("{key} = {value}"));
        self
    }

    /// Lines of the `[[stream]]` table as they are (`fill = "stamp"`, more
    /// keys from a test); empty lines are left out.
    pub fn raw(mut self, lines: &str) -> StreamToml {
        self.lines.extend(
            lines
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string),
        );
        self
    }

    pub fn to_toml(&self) -> String {
        format!("[[stream]]\n{}\n\n{}", self.lines.join("\n"), self.tables)
    }
}

/// A training stream named `name` over the ImageFolder at `root`:
/// RandomResizedCrop(`size`) + flip + ImageNet Normalize, f32 NCHW, batches
/// of 32, waiting for `consumers` subscribers; `extra` holds more keys of
/// the `[[stream]]` table. The demo and the image benchmark both run this.
pub fn image_stream_toml(
    name: &str,
    root: &Path,
    size: u32,
    epochs: u64,
    consumers: usize,
    extra: &str,
) -> String {
    StreamToml::image_folder(name, 32, root, size)
        .epochs(epochs)
        .key("shuffle", true)
        .key("seed", 2026)
        .key("slots", 6)
        .key("drop_last", false)
        .key("min_consumers", consumers)
        .raw(extra)
        .to_toml()
}
