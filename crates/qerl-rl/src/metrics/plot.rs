//! The end-of-run PNG: one panel per curve (reward, accuracy, entropy, completion length,
//! sigma, learning rate), drawn with plotters' bitmap backend and encoded with `png`.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::font;
use super::{MetricsError, StepMetrics};

/// Size of the PNG in pixels.
pub const PLOT_WIDTH: u32 = 1200;
pub const PLOT_HEIGHT: u32 = 900;

const MAIN: RGBColor = RGBColor(31, 119, 180);
const SECOND: RGBColor = RGBColor(255, 127, 14);
const GRID: RGBColor = RGBColor(225, 225, 225);
const FRAME: RGBColor = RGBColor(120, 120, 120);
const INK: RGBColor = RGBColor(30, 30, 30);

type Series = (Vec<(f64, f64)>, RGBColor);

struct Panel {
    title: &'static str,
    series: Vec<Series>,
}

fn curve(metrics: &[StepMetrics], f: impl Fn(&StepMetrics) -> f64) -> Vec<(f64, f64)> {
    metrics
        .iter()
        .map(|m| (m.step as f64, f(m)))
        .filter(|(_, y)| y.is_finite())
        .collect()
}

fn panels(metrics: &[StepMetrics]) -> Vec<Panel> {
    vec![
        Panel {
            title: "REWARD (MEAN)",
            series: vec![(curve(metrics, |m| m.reward_mean as f64), MAIN)],
        },
        Panel {
            title: "ACCURACY",
            series: vec![(curve(metrics, |m| m.accuracy as f64), MAIN)],
        },
        Panel {
            title: "ENTROPY",
            series: vec![(curve(metrics, |m| m.entropy as f64), MAIN)],
        },
        Panel {
            title: "LENGTH: MEAN (BLUE) / MAX (ORANGE)",
            series: vec![
                (curve(metrics, |m| m.completion_len_mean as f64), MAIN),
                (curve(metrics, |m| m.completion_len_max as f64), SECOND),
            ],
        },
        Panel {
            title: "AQN SIGMA",
            series: vec![(curve(metrics, |m| m.sigma as f64), MAIN)],
        },
        Panel {
            title: "LEARNING RATE",
            series: vec![(curve(metrics, |m| m.lr), MAIN)],
        },
    ]
}

/// Short text for an axis value: `0`, `0.125`, `1234`, `5.00E-4`.
fn fmt_num(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let a = v.abs();
    if !(1e-3..1e5).contains(&a) {
        return format!("{v:.2e}");
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

fn text<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, s: &str, x: i32, y: i32, scale: i32) {
    font::render(s, x, y, scale, |px, py| {
        // Out-of-image pixels are simply not drawn.
        let _ = root.draw_pixel((px, py), &INK);
    });
}

/// `lo..hi` widened so a flat or single-point curve still has a non-empty range.
fn padded(lo: f64, hi: f64) -> (f64, f64) {
    if hi > lo {
        let pad = (hi - lo) * 0.05;
        (lo - pad, hi + pad)
    } else {
        let pad = (lo.abs() * 0.05).max(1e-6);
        (lo - pad, hi + pad)
    }
}

fn draw_panel<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
) -> Result<(), String> {
    let (bx, by) = area.get_base_pixel();
    text(root, panel.title, bx + 12, by + 8, 2);
    let plot = area.margin(32, 26, 80, 20);
    let (px, py) = plot.get_base_pixel();
    let (pw, ph) = plot.dim_in_pixel();
    let (pw, ph) = (pw as i32, ph as i32);
    root.draw(&Rectangle::new(
        [(px - 1, py - 1), (px + pw, py + ph)],
        FRAME.stroke_width(1),
    ))
    .map_err(|e| e.to_string())?;

    let points: Vec<&(f64, f64)> = panel.series.iter().flat_map(|(s, _)| s).collect();
    if points.is_empty() {
        text(
            root,
            "NO DATA",
            px + pw / 2 - font::text_width("NO DATA", 2) / 2,
            py + ph / 2 - 7,
            2,
        );
        return Ok(());
    }
    let fold = |f: fn(f64, f64) -> f64, init: f64, sel: fn(&(f64, f64)) -> f64| {
        points.iter().map(|p| sel(p)).fold(init, f)
    };
    let (x0, x1) = {
        let (lo, hi) = (
            fold(f64::min, f64::INFINITY, |p| p.0),
            fold(f64::max, f64::NEG_INFINITY, |p| p.0),
        );
        if hi > lo {
            (lo, hi)
        } else {
            (lo - 0.5, hi + 0.5)
        }
    };
    let (y_lo, y_hi) = (
        fold(f64::min, f64::INFINITY, |p| p.1),
        fold(f64::max, f64::NEG_INFINITY, |p| p.1),
    );
    let (y0, y1) = padded(y_lo, y_hi);

    let mut chart = ChartBuilder::on(&plot)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| e.to_string())?;
    for i in 1..4 {
        let y = y0 + (y1 - y0) * i as f64 / 4.0;
        chart
            .draw_series(LineSeries::new([(x0, y), (x1, y)], GRID))
            .map_err(|e| e.to_string())?;
    }
    for (series, color) in &panel.series {
        if series.len() == 1 {
            chart
                .draw_series(series.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| e.to_string())?;
        } else {
            chart
                .draw_series(LineSeries::new(
                    series.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| e.to_string())?;
        }
    }

    let (top, bottom) = (fmt_num(y_hi), fmt_num(y_lo));
    text(root, &top, px - 6 - font::text_width(&top, 1), py, 1);
    text(
        root,
        &bottom,
        px - 6 - font::text_width(&bottom, 1),
        py + ph - font::text_height(1),
        1,
    );
    let (left, right) = (
        format!("STEP {}", fmt_num(x0.max(0.0).round())),
        fmt_num(x1.round()),
    );
    text(root, &left, px, py + ph + 8, 1);
    text(
        root,
        &right,
        px + pw - font::text_width(&right, 1),
        py + ph + 8,
        1,
    );
    Ok(())
}

fn draw(buf: &mut [u8], metrics: &[StepMetrics]) -> Result<(), String> {
    let root = BitMapBackend::with_buffer(buf, (PLOT_WIDTH, PLOT_HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((3, 2));
    for (panel, area) in panels(metrics).iter().zip(&areas) {
        draw_panel(&root, area, panel)?;
    }
    root.present().map_err(|e| e.to_string())
}

/// Draws the run's curves into a PNG at `path` (created or replaced). Non-finite values are
/// skipped; an empty run gives panels that say "NO DATA".
pub fn plot_run(metrics: &[StepMetrics], path: &Path) -> Result<(), MetricsError> {
    let mut buf = vec![0u8; (PLOT_WIDTH * PLOT_HEIGHT * 3) as usize];
    draw(&mut buf, metrics).map_err(|message| MetricsError::Plot {
        path: path.to_path_buf(),
        message,
    })?;
    let io = |e: std::io::Error| MetricsError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let png_err = |e: png::EncodingError| MetricsError::Plot {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let file = File::create(path).map_err(io)?;
    let mut encoder = png::Encoder::new(BufWriter::new(file), PLOT_WIDTH, PLOT_HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(png_err)?;
    writer.write_image_data(&buf).map_err(png_err)?;
    writer.finish().map_err(png_err)
}
