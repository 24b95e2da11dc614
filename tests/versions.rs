//! The release number says the protocol: release `0.N` speaks protocol
//! `N` (from 0.26 on), docs/install.md's table of releases ends with this
//! build's, and every place that names the release to install (README's
//! wheel, the install guide, the Kubernetes images, the sample stats
//! doctor reads) names this one. A protocol change without a new release
//! number fails here, so a version-mismatch message's `pip install` line
//! always names a release that speaks the protocol it asks for.

use std::path::Path;

use batchcast::proto::PROTOCOL_VERSION;

const RELEASE: &str = env!("CARGO_PKG_VERSION");

fn read(rel: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The workspace's (major, minor).
fn line() -> (u32, u32) {
    let mut parts = RELEASE.split('.').map(|p| p.parse::<u32>().unwrap());
    (parts.next().unwrap(), parts.next().unwrap())
}

#[test]
fn release_0_n_speaks_protocol_n() {
    let (major, minor) = line();
    assert_eq!(
        (major, minor),
        (0, u32::from(PROTOCOL_VERSION)),
        "release {RELEASE} with protocol {PROTOCOL_VERSION}: a new protocol is a new release \
         0.{PROTOCOL_VERSION}.0 (the workspace's `version` in Cargo.toml, and this table's last row in \
         docs/install.md)"
    );
}

#[test]
fn the_install_guides_table_ends_with_this_release_and_protocol() {
    let guide = read("docs/install.md");
    let rows: Vec<(String, String)> = guide
        .lines()
        .skip_while(|l| !l.starts_with("| release | protocol |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            (cells[0].to_string(), cells[1].to_string())
        })
        .collect();
    assert!(rows.len() >= 2, "no table of releases in docs/install.md");
    let (major, minor) = line();
    assert_eq!(
        rows.last().unwrap(),
        &(format!("{major}.{minor}"), PROTOCOL_VERSION.to_string()),
        "docs/install.md's last release row: {rows:?}"
    );
    // Releases and protocols only grow down the table.
    let firsts: Vec<u32> = rows
        .iter()
        .map(|(_, p)| p.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{rows:?}");
}

#[test]
fn every_place_naming_a_release_to_install_names_this_one() {
    let wheel = format!("batchcast-{RELEASE}-cp39-abi3");
    let image = format!("batchcast:{RELEASE}");
    let places = [
        ("README.md", wheel.as_str()),
        ("docs/install.md", wheel.as_str()),
        (
            "docs/install.md",
            &format!("batchcast {RELEASE} (protocol {PROTOCOL_VERSION})"),
        ),
        ("deploy/k8s/trainer-job.yaml", image.as_str()),
        ("deploy/k8s/broker-daemonset.yaml", image.as_str()),
        (
            "cli/src/doctor_demo_stats.json",
            &format!("\"broker_version\": \"{RELEASE}\""),
        ),
    ];
    for (file, want) in places {
        assert!(read(file).contains(want), "{file} does not name `{want}`");
    }
    // No other release's wheel or image is named anywhere of these.
    for file in [
        "README.md",
        "docs/install.md",
        "deploy/k8s/trainer-job.yaml",
    ] {
        let text = read(file);
        for (at, _) in text.match_indices("batchcast-0.") {
            assert!(
                text[at..].starts_with(&wheel),
                "{file}: {}",
                &text[at..at + 30]
            );
        }
    }
}
