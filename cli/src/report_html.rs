//! One self-contained HTML file about a run (`launch --report`, `demo
//! --report`, `doctor --html`): doctor's verdict and predictions, and the
//! run over time (samples/s and stall per trainer, the broker's CPU by
//! stage, memory), the shared run and the baseline side by side. Plots
//! are inline SVG; the page has no script and loads nothing.

use std::fmt::Write as _;

use batchcast_cli::report::{RunSummary, Summary};

use super::finding::Finding;
use super::predict;

/// Line colours, one per series in turn.
const COLOURS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// A named line: (x, y) points.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

/// The page: `summary` (a finished run) if there is one, and doctor's
/// findings.
pub fn page(title: &str, summary: Option<&Summary>, findings: &[Finding]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>{t}</title><style>{STYLE}</style></head><body>\n<h1>{t}</h1>\n",
        t = esc(title)
    );
    out.push_str("<h2>What limits the trainers</h2>\n");
    if findings.is_empty() {
        out.push_str("<p>No stream to judge.</p>\n");
    }
    for f in findings {
        finding(&mut out, f);
    }
    if let Some(s) = summary {
        runs(&mut out, s);
    }
    out.push_str("</body></html>\n");
    out
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1240px}\
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}\
.card{border:1px solid #ccc;border-radius:6px;padding:10px 14px;margin:10px 0}\
.verdict{font-size:15px;font-weight:600}\
table{border-collapse:collapse;margin:6px 0}td,th{padding:2px 10px;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}\
.pair{display:flex;gap:16px;flex-wrap:wrap}.pair>div{flex:1;min-width:560px}\
svg{background:#fff}svg text{font:11px system-ui,sans-serif;fill:#333}";

fn finding(out: &mut String, f: &Finding) {
    let _ = write!(
        out,
        "<div class=\"card\"><p class=\"verdict\">stream <code>{}</code>: {}</p><table>",
        esc(&f.stream),
        esc(&f.verdict)
    );
    for (k, v) in &f.evidence {
        let _ = write!(out, "<tr><td>{}</td><td>{}</td></tr>", esc(k), esc(v));
    }
    out.push_str("</table>");
    if let Some(m) = &f.model {
        let now = m.inputs.images_s;
        let _ = write!(
            out,
            "<p>The model ({}): {:.0} images/s now against {now:.0} measured, limited by {}.</p>",
            esc(&m.inputs.describe()),
            m.now.images_s,
            m.now.limit.says()
        );
        let mut rows = vec![("now (measured)".to_string(), now)];
        rows.extend(
            m.predictions
                .iter()
                .map(|p| (p.what.clone(), p.rate.images_s)),
        );
        out.push_str(&bars("images/s after each change", &rows));
        out.push_str("<ul>");
        for p in &m.predictions {
            let _ = write!(out, "<li>{}</li>", esc(&predict::line(p, now)));
        }
        out.push_str("</ul>");
    }
    out.push_str("</div>\n");
}

/// The runs' table and their plots, shared and baseline side by side.
fn runs(out: &mut String, s: &Summary) {
    let both: Vec<(&str, &RunSummary)> = std::iter::once(("shared", &s.shared))
        .chain(s.baseline.as_ref().map(|b| ("baseline", b)))
        .collect();
    out.push_str("<h2>The runs</h2>\n<table><tr><th>run</th><th>trainers</th><th>wall s</th><th>samples/s</th><th>CPU ms per sample</th></tr>");
    for (name, r) in &both {
        let _ = write!(
            out,
            "<tr><td>{name}</td><td class=\"n\">{}</td><td class=\"n\">{:.1}</td><td class=\"n\">{:.0}</td><td class=\"n\">{}</td></tr>",
            r.trainers.len(),
            r.wall_s,
            r.samples_per_s,
            r.cpu_ms_per_sample
                .map_or("-".into(), |c| format!("{c:.3}"))
        );
    }
    out.push_str("</table>");
    if let Some(c) = &s.comparison {
        let _ = write!(
            out,
            "<p>Shared against baseline: {:.2}x the samples/s, {:.2}x faster{}.</p>",
            c.throughput_ratio,
            c.speedup,
            c.cpu_per_sample_ratio
                .map_or(String::new(), |r| format!(", {r:.2}x the CPU per sample"))
        );
    }
    type Plot = fn(&RunSummary) -> Vec<Series>;
    // (title, unit, plot, y top, whether it is the brokers')
    let plots: [(&str, &str, Plot, Option<f64>, bool); 4] = [
        ("Samples/s per trainer", "samples/s", rates, None, false),
        (
            "Data stall per trainer",
            "% waiting",
            stalls,
            Some(100.0),
            false,
        ),
        (
            "Broker CPU by stage",
            "cores, split by the pipeline's time in each stage; threads working",
            stages,
            None,
            true,
        ),
        ("Broker memory", "MiB", memory, None, true),
    ];
    for (title, unit, plot, y_max, brokers) in plots {
        let _ = write!(out, "<h2>{title}</h2>\n<div class=\"pair\">");
        for (name, r) in &both {
            // A run without a broker (a baseline's own loaders) has no
            // panel to draw: it says so instead.
            if brokers && r.brokers.is_empty() {
                let _ = write!(
                    out,
                    "<div><p>{name}: no broker in this run (each trainer had its own loader).</p></div>"
                );
                continue;
            }
            let series = plot(r);
            let marks: Vec<f64> = r.events.iter().map(|e| e.t_s).collect();
            let _ = write!(
                out,
                "<div>{}</div>",
                chart(name, unit, &series, (y_max, &marks))
            );
        }
        out.push_str("</div>\n");
    }
    events(out, &both);
}

/// Each run's events, listed with their times.
fn events(out: &mut String, both: &[(&str, &RunSummary)]) {
    for (name, r) in both {
        if r.events.is_empty() {
            continue;
        }
        let _ = write!(
            out,
            "<h2>What happened ({name})</h2>\n<p>Each is a dashed line on the time axes above.</p><ul>"
        );
        for e in &r.events {
            let _ = write!(out, "<li>{:.1} s: {}</li>", e.t_s, esc(&e.text));
        }
        out.push_str("</ul>\n");
    }
}

/// Rates are taken over at least this long: figures that trainers report
/// every few seconds read 0 between two reports and double after over a
/// tick's second alone.
const RATE_WINDOW_S: f64 = 5.0;

/// For each tick, the tick [`RATE_WINDOW_S`] or more before it (the
/// run's first while it is younger than that).
fn windows(r: &RunSummary) -> Vec<(usize, usize)> {
    let t = &r.timeline;
    let mut from = 0;
    (1..t.len())
        .map(|j| {
            while from + 1 < j && t[j].t_s - t[from + 1].t_s >= RATE_WINDOW_S {
                from += 1;
            }
            (from, j)
        })
        .collect()
}

/// Differences of a tick's figure over a window of ticks, per second.
fn per_second(
    r: &RunSummary,
    value: impl Fn(&batchcast_cli::report::Tick) -> Option<f64>,
) -> Vec<(f64, f64)> {
    let t = &r.timeline;
    windows(r)
        .into_iter()
        .filter_map(|(i, j)| {
            let dt = t[j].t_s - t[i].t_s;
            let d = value(&t[j])? - value(&t[i])?;
            (dt > 0.0).then(|| (t[j].t_s, (d / dt).max(0.0)))
        })
        .collect()
}

fn rates(r: &RunSummary) -> Vec<Series> {
    (0..r.trainers.len())
        .map(|i| Series {
            name: r.trainers[i].name.clone(),
            points: per_second(r, |t| t.trainers.get(i).map(|x| x[0])),
        })
        .collect()
}

fn stalls(r: &RunSummary) -> Vec<Series> {
    (0..r.trainers.len())
        .map(|i| Series {
            name: r.trainers[i].name.clone(),
            points: windows(r)
                .into_iter()
                .filter_map(|(from, to)| {
                    let t = &r.timeline;
                    let (a, b) = (t[from].trainers.get(i)?, t[to].trainers.get(i)?);
                    let (wait, busy) = (b[1] - a[1], b[2] - a[2]);
                    (wait + busy > 1e-3).then(|| (t[to].t_s, 100.0 * wait / (wait + busy)))
                })
                .collect(),
        })
        .collect()
}

/// Every broker of the run together: its CPU (what /proc says), and that
/// CPU split by its pipeline threads' time in each stage over the same
/// window, so the stages add up to the CPU (the stage clock is wall time:
/// a thread waiting for a core or a read counts in it, and stats read
/// between two ticks can put seconds of it in one).
fn stages(r: &RunSummary) -> Vec<Series> {
    let t = &r.timeline;
    let sum = |k: &batchcast_cli::report::Tick,
               f: &dyn Fn(&batchcast_cli::report::BrokerTick) -> f64| {
        k.brokers.iter().map(f).sum::<f64>()
    };
    let mut cpu = Vec::new();
    let mut by_stage: [Vec<(f64, f64)>; 3] = Default::default();
    for (i, j) in windows(r) {
        let dt = t[j].t_s - t[i].t_s;
        if dt <= 0.0 {
            continue;
        }
        let cores = (sum(&t[j], &|b| b.cpu_s) - sum(&t[i], &|b| b.cpu_s)).max(0.0) / dt;
        cpu.push((t[j].t_s, cores));
        let d: Vec<f64> = (0..3)
            .map(|s| (sum(&t[j], &|b| b.stages[s]) - sum(&t[i], &|b| b.stages[s])).max(0.0))
            .collect();
        let all: f64 = d.iter().sum();
        for (s, points) in by_stage.iter_mut().enumerate() {
            let share = if all > 0.0 { d[s] / all } else { 0.0 };
            points.push((t[j].t_s, cores * share));
        }
    }
    let [reading, decoding, transforming] = by_stage;
    // Beside the cores they take, the pipeline threads working.
    let threads = t
        .iter()
        .map(|k| {
            (
                k.t_s,
                f64::from(k.brokers.iter().map(|b| b.threads_working).sum::<u32>()),
            )
        })
        .collect();
    vec![
        Series {
            name: "broker CPU".into(),
            points: cpu,
        },
        Series {
            name: "threads working".into(),
            points: threads,
        },
        Series {
            name: "reading".into(),
            points: reading,
        },
        Series {
            name: "decoding".into(),
            points: decoding,
        },
        Series {
            name: "transforming".into(),
            points: transforming,
        },
    ]
}

fn memory(r: &RunSummary) -> Vec<Series> {
    let mib = |f: fn(&batchcast_cli::report::BrokerTick) -> u64| {
        r.timeline
            .iter()
            .map(|t| {
                let bytes: u64 = t.brokers.iter().map(f).sum();
                (t.t_s, bytes as f64 / f64::from(1 << 20))
            })
            .collect()
    };
    vec![
        Series {
            name: "resident".into(),
            points: mib(|b| b.rss_bytes),
        },
        Series {
            name: "shared (batches)".into(),
            points: mib(|b| b.shared_bytes),
        },
    ]
}

const W: f64 = 560.0;
const H: f64 = 240.0;
/// Plot area: left, top, right, bottom margins.
const M: (f64, f64, f64, f64) = (52.0, 26.0, 120.0, 30.0);

/// A line chart of `series` over seconds, with axes, ticks and a legend.
fn chart(
    title: &str,
    unit: &str,
    series: &[Series],
    (y_max, marks): (Option<f64>, &[f64]),
) -> String {
    let all = || series.iter().flat_map(|s| &s.points);
    let (x_max, x_step) = axis(all().map(|p| p.0).fold(0.0, f64::max));
    let (y_top, y_step) = match y_max {
        Some(top) => (top, top / 5.0),
        None => axis(all().map(|p| p.1).fold(0.0, f64::max)),
    };
    let (pw, ph) = (W - M.0 - M.2, H - M.1 - M.3);
    let x = |v: f64| M.0 + pw * v / x_max;
    let y = |v: f64| M.1 + ph * (1.0 - v / y_top.max(1e-12));
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" role=\"img\">\
         <text x=\"{M0}\" y=\"16\" font-weight=\"600\">{t} ({u})</text>",
        M0 = M.0,
        t = esc(title),
        u = esc(unit)
    );
    for i in 0..=(y_top / y_step).round() as u32 {
        let v = y_step * f64::from(i);
        let _ = write!(
            svg,
            "<line x1=\"{M0}\" x2=\"{x2}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#eee\"/>\
             <text x=\"{tx}\" y=\"{ty:.1}\" text-anchor=\"end\">{v}</text>",
            M0 = M.0,
            x2 = M.0 + pw,
            yy = y(v),
            tx = M.0 - 4.0,
            ty = y(v) + 4.0,
            v = short(v)
        );
    }
    svg.push_str(&seconds_axis((x_max, x_step), &x));
    let _ = write!(
        svg,
        "<rect x=\"{}\" y=\"{}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>",
        M.0, M.1
    );
    for (k, s) in series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let points: Vec<String> = s
            .points
            .iter()
            .map(|&(a, b)| format!("{:.1},{:.1}", x(a), y(b.min(y_top))))
            .collect();
        let _ = write!(
            svg,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.6\" points=\"{}\"/>\
             <rect x=\"{lx}\" y=\"{ly:.1}\" width=\"10\" height=\"10\" fill=\"{colour}\"/>\
             <text x=\"{tx}\" y=\"{ty:.1}\">{n}</text>",
            points.join(" "),
            lx = W - M.2 + 10.0,
            ly = M.1 + 16.0 * k as f64,
            tx = W - M.2 + 24.0,
            ty = M.1 + 9.0 + 16.0 * k as f64,
            n = esc(&s.name)
        );
    }
    // Events (a trainer cut, detached, ended; a broker restarted).
    for &m in marks.iter().filter(|&&m| m <= x_max) {
        svg.push_str(&mark(x(m), ph));
    }
    if series.iter().all(|s| s.points.is_empty()) {
        let _ = write!(
            svg,
            "<text x=\"{}\" y=\"{}\">no samples over time in this run</text>",
            M.0 + 10.0,
            M.1 + 20.0
        );
    }
    svg.push_str("</svg>");
    svg
}

/// The time axis's labels, every `step` up to `max` seconds, placed by `x`.
fn seconds_axis((max, step): (f64, f64), x: &dyn Fn(f64) -> f64) -> String {
    let mut out = String::new();
    for i in 0..=(max / step).round() as u32 {
        let s = step * f64::from(i);
        let _ = write!(
            out,
            "<text x=\"{xx:.1}\" y=\"{ty}\" text-anchor=\"middle\">{} s</text>",
            short(s),
            xx = x(s),
            ty = H - 10.0
        );
    }
    out
}

/// An event's dashed line across a plot of height `ph`, at `xx`.
fn mark(xx: f64, ph: f64) -> String {
    format!(
        "<line class=\"event\" x1=\"{xx:.1}\" y1=\"{}\" x2=\"{xx:.1}\" y2=\"{}\" stroke=\"#b00\" stroke-dasharray=\"3,3\"/>",
        M.1,
        M.1 + ph
    )
}

/// Horizontal bars, one per row, scaled to the largest.
fn bars(title: &str, rows: &[(String, f64)]) -> String {
    let top = rows.iter().map(|r| r.1).fold(0.0, f64::max).max(1e-12);
    let (label, bar_w, row_h) = (300.0, 360.0, 20.0);
    let h = 24.0 + row_h * rows.len() as f64;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" role=\"img\">\
         <text x=\"0\" y=\"14\" font-weight=\"600\">{t}</text>",
        w = label + bar_w + 70.0,
        t = esc(title)
    );
    for (i, (name, v)) in rows.iter().enumerate() {
        let yy = 22.0 + row_h * i as f64;
        let colour = if i == 0 { "#888" } else { COLOURS[0] };
        let _ = write!(
            svg,
            "<text x=\"{tx}\" y=\"{ty:.1}\" text-anchor=\"end\">{n}</text>\
             <rect x=\"{label}\" y=\"{yy:.1}\" width=\"{bw:.1}\" height=\"14\" fill=\"{colour}\"/>\
             <text x=\"{vx:.1}\" y=\"{ty:.1}\">{v:.0}</text>",
            tx = label - 6.0,
            ty = yy + 11.0,
            n = esc(name),
            bw = bar_w * v / top,
            vx = label + bar_w * v / top + 4.0
        );
    }
    svg.push_str("</svg>");
    svg
}

/// An axis for values up to `v`: a step of 1, 2 or 5 times a power of
/// ten giving at most 5 intervals, and the first multiple of it at or
/// above `v`.
fn axis(v: f64) -> (f64, f64) {
    if v <= 0.0 || !v.is_finite() {
        return (1.0, 0.2);
    }
    let raw = v / 5.0;
    let p = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&t| t >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * p);
    ((v / step - 1e-9).ceil().max(1.0) * step, step)
}

/// A tick's label: at most two decimals, none trailing.
fn short(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Text made safe inside HTML and SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_escaped_and_axes_are_round() {
        assert_eq!(esc("<a & \"b\">"), "&lt;a &amp; &quot;b&quot;&gt;");
        assert_eq!(axis(0.0), (1.0, 0.2));
        assert_eq!(axis(6.2), (8.0, 2.0));
        assert_eq!(axis(1234.0), (1500.0, 500.0));
        assert_eq!(axis(100.0), (100.0, 20.0));
        assert_eq!(
            (short(0.4), short(1.0), short(1.25)),
            ("0.4".into(), "1".into(), "1.25".into())
        );
    }

    #[test]
    fn a_chart_draws_one_line_per_series_inside_its_box() {
        let series = [
            Series {
                name: "t<0>".into(),
                points: vec![(1.0, 10.0), (2.0, 30.0)],
            },
            Series {
                name: "t1".into(),
                points: vec![(1.0, 5.0), (2.0, 500.0)],
            },
        ];
        let svg = chart("rate", "samples/s", &series, (Some(100.0), &[]));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("t&lt;0&gt;") && !svg.contains("t<0>"));
        // 500 is clipped to the top of a 0-100 axis (y = the top margin).
        assert!(svg.contains(&format!("{:.1},{:.1}", W - M.2, M.1)), "{svg}");
    }

    /// A run whose trainer reports every 2 s, ticked every second, whose
    /// broker's stage clock ran ahead of its CPU (3 s of decoding in a
    /// second of one thread), with a cut at 6 s.
    fn run(brokers: bool) -> RunSummary {
        use batchcast_cli::report::{BrokerTick, Event, Mode, Tick};
        let timeline = (0..20u32)
            .map(|k| {
                let s = f64::from(k);
                Tick {
                    t_s: s,
                    trainers: vec![[f64::from(k / 2 * 200), 0.1 * s, 0.9 * s]],
                    brokers: if brokers {
                        vec![BrokerTick {
                            cpu_s: 0.9 * s,
                            stages: [0.1 * s, 3.0 * s, 0.4 * s],
                            ..BrokerTick::default()
                        }]
                    } else {
                        Vec::new()
                    },
                }
            })
            .collect();
        RunSummary {
            mode: if brokers {
                Mode::Shared
            } else {
                Mode::Baseline
            },
            dir: "run".into(),
            wall_s: 19.0,
            samples: 1800,
            samples_per_s: 95.0,
            cpu_s: 20.0,
            cpu_ms_per_sample: Some(11.0),
            failed: 0,
            interrupted: false,
            trainers: Vec::new(),
            brokers: Vec::new(),
            timeline,
            events: vec![Event {
                t_s: 6.0,
                text: "t-0 was cut to replay".into(),
            }],
        }
    }

    /// Rates span several reports (no 0 / 200 sawtooth); the stages add
    /// up to the broker's CPU; a cut is a mark on the time axis and a
    /// line of what happened; a run without a broker gets no broker panel.
    #[test]
    fn rates_are_smooth_stages_add_up_to_the_cpu_and_events_are_marked() {
        let r = run(true);
        let rates: Vec<f64> = per_second(&r, |t| Some(t.trainers[0][0]))
            .into_iter()
            .map(|p| p.1)
            .collect();
        for v in &rates[5..] {
            assert!((80.0..=120.0).contains(v), "{rates:?}");
        }
        let st = stages(&r);
        for k in 0..st[0].points.len() {
            let cpu = st[0].points[k].1;
            let parts: f64 = st[1..].iter().map(|s| s.points[k].1).sum();
            assert!(
                (cpu - 0.9).abs() < 1e-9 && (parts - cpu).abs() < 1e-9,
                "{k}"
            );
            assert!(st[2].points[k].1 <= cpu, "decoding above the CPU");
        }
        let mut summary_shared = r.clone();
        summary_shared.brokers = vec![batchcast_cli::report::BrokerSummary {
            socket: "b.sock".into(),
            pid: 1,
            started: true,
            restarts: 0,
            cpu_s: 17.0,
            batches_produced: 0,
            deliveries: 0,
            images_decoded: 0,
            cache_hits: 0,
            bad_files_skipped: 0,
            last_stats: None,
            run_queue_s: Default::default(),
        }];
        let mut html = String::new();
        runs(
            &mut html,
            &Summary {
                sweep: "s.toml".into(),
                on_failure: Default::default(),
                exit_code: 0,
                shared: summary_shared,
                baseline: Some(run(false)),
                comparison: None,
            },
        );
        assert!(html.contains("class=\"event\""), "no event mark");
        assert!(html.contains("6.0 s: t-0 was cut to replay"));
        assert_eq!(
            html.matches("baseline: no broker in this run").count(),
            2,
            "the baseline's two broker panels say so instead"
        );
    }
}
