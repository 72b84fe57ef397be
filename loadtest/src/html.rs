//! Self-contained HTML reports: tables plus charts drawn by uPlot (a small MIT-licensed plotting
//! library, inlined from `loadtest/assets/uplot/`), so a report opens offline from a single file.

use serde::Serialize;
use serde_json::json;

const UPLOT_JS: &str = include_str!("../assets/uplot/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/uplot/uPlot.min.css");

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Style {
    /// Joined points.
    Line,
    /// Unjoined points.
    Points,
    /// Vertical bars.
    Bars,
}

/// One y series over the chart's x values (`None` = no value at that x).
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    /// Legend label.
    pub label: String,
    /// Values, one per x.
    pub values: Vec<Option<f64>>,
    /// Drawing style.
    pub style: Style,
}

/// A chart.
#[derive(Debug, Clone, Serialize)]
pub struct Chart {
    /// Title above the chart.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Logarithmic x axis.
    pub log_x: bool,
    /// Logarithmic y axis.
    pub log_y: bool,
    /// X values, ascending.
    pub x: Vec<f64>,
    /// The series.
    pub series: Vec<Series>,
}

/// A block of the page: a heading, pre-rendered HTML (tables, text), then charts.
#[derive(Debug, Clone, Default)]
pub struct Section {
    /// Heading.
    pub heading: String,
    /// HTML shown under the heading (callers escape what they put in it).
    pub html: String,
    /// Charts.
    pub charts: Vec<Chart>,
}

/// Escapes text for HTML.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An HTML table from a header and rows of already-escaped cells.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = String::from("<table><thead><tr>");
    for h in header {
        out.push_str(&format!("<th>{}</th>", escape(h)));
    }
    out.push_str("</tr></thead><tbody>");
    for r in rows {
        out.push_str("<tr>");
        for c in r {
            out.push_str(&format!("<td>{c}</td>"));
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
    out
}

/// The whole page.
pub fn page(title: &str, subtitle: &str, sections: &[Section]) -> String {
    let mut body = String::new();
    let mut charts = Vec::new();
    for s in sections {
        body.push_str(&format!(
            "<section><h2>{}</h2>{}",
            escape(&s.heading),
            s.html
        ));
        for c in &s.charts {
            let id = format!("chart{}", charts.len());
            body.push_str(&format!("<div class=\"chart\" id=\"{id}\"></div>"));
            charts.push(json!({"id": id, "chart": c}));
        }
        body.push_str("</section>");
    }
    let data = serde_json::to_string(&charts)
        .unwrap_or_else(|_| "[]".into())
        .replace("</", "<\\/");
    format!(
        r##"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{UPLOT_CSS}
body{{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}}
h1{{margin-bottom:0}} .sub{{color:#666;margin-top:.3em}}
table{{border-collapse:collapse;margin:1em 0;font-size:14px}} td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}
th{{background:#f3f3f3}} td:first-child,th:first-child{{text-align:left}}
.chart{{margin:1em 0 2em}} .warn{{background:#fff3cd;padding:.6em;border:1px solid #e0c060}}
pre{{background:#f7f7f7;padding:.8em;overflow-x:auto;font-size:12px}}
</style></head><body>
<h1>{title}</h1><p class="sub">{subtitle}</p>
{body}
<script>{UPLOT_JS}</script>
<script>
const CHARTS = {data};
const COLORS = ["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b","#17becf"];
for (const {{id, chart}} of CHARTS) {{
  const el = document.getElementById(id);
  const series = [{{label: chart.x_label}}].concat(chart.series.map((s, i) => {{
    const c = COLORS[i % COLORS.length];
    const o = {{label: s.label, stroke: c, width: 2}};
    if (s.style === "points") {{ o.paths = () => null; o.points = {{show: true, size: 4, stroke: c, fill: c}}; }}
    if (s.style === "bars") {{ o.paths = uPlot.paths.bars({{size: [0.9, 60]}}); o.fill = c + "88"; o.points = {{show: false}}; }}
    return o;
  }}));
  const opts = {{
    title: chart.title, width: Math.min(1000, window.innerWidth - 60), height: 320,
    scales: {{x: {{time: false, distr: chart.log_x ? 3 : 1}}, y: {{distr: chart.log_y ? 3 : 1}}}},
    axes: [{{label: chart.x_label}}, {{label: chart.y_label}}],
    series: series,
  }};
  new uPlot(opts, [chart.x].concat(chart.series.map(s => s.values)), el);
}}
document.body.dataset.charts = String(CHARTS.length);
</script></body></html>
"##,
        title = escape(title),
        subtitle = escape(subtitle),
    )
}

/// x/y pairs of an empirical CDF of `sorted` values (at most `points` of them).
pub fn cdf(sorted: &[f64], points: usize) -> (Vec<f64>, Vec<Option<f64>>) {
    if sorted.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let step = (sorted.len() / points.max(1)).max(1);
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for i in (0..sorted.len())
        .step_by(step)
        .chain(std::iter::once(sorted.len() - 1))
    {
        if xs.last() == Some(&sorted[i]) {
            continue;
        }
        xs.push(sorted[i]);
        ys.push(Some((i + 1) as f64 / sorted.len() as f64));
    }
    (xs, ys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_inline_the_library_and_escape_text() {
        let chart = Chart {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_x: false,
            log_y: false,
            x: vec![1.0, 2.0],
            series: vec![Series {
                label: "</script>".into(),
                values: vec![Some(1.0), None],
                style: Style::Line,
            }],
        };
        let html = page(
            "a<b",
            "sub",
            &[Section {
                heading: "h".into(),
                html: String::new(),
                charts: vec![chart],
            }],
        );
        assert!(html.contains("a&lt;b"));
        assert!(html.contains("uPlot"));
        assert!(
            !html.contains("\"</script>\""),
            "JSON must not close the script tag"
        );
        assert!(html.contains("id=\"chart0\""));
    }

    #[test]
    fn cdf_ends_at_one_and_is_monotonic() {
        let v: Vec<f64> = (0..1000).map(f64::from).collect();
        let (x, y) = cdf(&v, 100);
        assert_eq!(y.last().copied().flatten(), Some(1.0));
        assert!(x.windows(2).all(|w| w[0] < w[1]));
        assert!(x.len() <= 102);
    }
}
