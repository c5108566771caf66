//! Sparklines drawn on the server with plotters' SVG backend: no canvas code and no script in the
//! browser, and the markup comes from numbers only, so it is the one thing pages insert unescaped.

use plotters::prelude::*;

/// Width and height of a sparkline, in CSS pixels.
pub const SIZE: (u32, u32) = (160, 28);

/// An inline SVG of `values` (one per minute, oldest first) as a filled line, scaled to its own
/// maximum. An empty string when there is nothing to draw or plotting fails (the page then shows
/// the numbers alone).
pub fn sparkline(values: &[i64]) -> String {
    if values.is_empty() {
        return String::new();
    }
    let max = values.iter().copied().max().unwrap_or(0).max(1) as f64;
    // A single point cannot make a line: draw it as a flat segment.
    let points: Vec<(f64, f64)> = if values.len() == 1 {
        vec![(0.0, values[0] as f64), (1.0, values[0] as f64)]
    } else {
        values.iter().enumerate().map(|(i, v)| (i as f64, (*v).max(0) as f64)).collect()
    };
    let x_max = points.last().map(|p| p.0).unwrap_or(1.0).max(1.0);
    let mut svg = String::new();
    let drawn = (|| -> Result<(), Box<dyn std::error::Error + '_>> {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        let mut chart = ChartBuilder::on(&root).margin(2).build_cartesian_2d(0.0..x_max, 0.0..max)?;
        let line = RGBColor(0x1f, 0x6f, 0xb5);
        chart.draw_series(
            AreaSeries::new(points.iter().copied(), 0.0, line.mix(0.18)).border_style(line.stroke_width(1)),
        )?;
        root.present()?;
        Ok(())
    })();
    match drawn {
        Ok(()) => svg,
        Err(e) => {
            tracing::debug!("sparkline: {e}");
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_an_svg() {
        let s = sparkline(&[0, 3, 1, 7, 0, 2]);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"), "{s}");
        assert!(s.contains("polyline") || s.contains("path") || s.contains("polygon"), "{s}");
    }

    #[test]
    fn edge_cases_do_not_panic() {
        assert_eq!(sparkline(&[]), "");
        assert!(sparkline(&[5]).starts_with("<svg"));
        assert!(sparkline(&[0, 0, 0]).starts_with("<svg"));
        assert!(sparkline(&[-1, i64::MAX]).starts_with("<svg"));
    }
}
