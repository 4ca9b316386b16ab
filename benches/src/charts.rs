//! Small raster charts for the benchmark report: the distribution of samples (boot
//! time) as box plots with the samples as dots, and horizontal bars (memory per
//! VM), each a pure function from data to PNG bytes.
//!
//! Everything is drawn by hand on an RGB [`Canvas`] with an embedded 5x8 bitmap
//! font, so the harness needs no plotting stack, font files or system libraries:
//! only the pure-Rust `png` crate to encode. Output is deterministic (the dots'
//! jitter included), so the same data gives the same bytes.

use std::fmt;

/// One distribution to plot: e.g. `vmctl` boot times in ms.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub samples: Vec<f64>,
}

/// One horizontal bar; `reference` adds a dashed "target" marker at that value.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub label: String,
    pub value: f64,
    pub reference: Option<f64>,
}

#[derive(Debug)]
pub enum ChartError {
    /// Nothing to plot: no series or bars, or none with a finite value.
    NoData,
    /// The PNG encoder failed (only on I/O errors of the in-memory writer).
    Encode(png::EncodingError),
}

impl fmt::Display for ChartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChartError::NoData => f.write_str("no finite data to plot"),
            ChartError::Encode(e) => write!(f, "PNG encoding failed: {e}"),
        }
    }
}

impl std::error::Error for ChartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ChartError::NoData => None,
            ChartError::Encode(e) => Some(e),
        }
    }
}

impl From<png::EncodingError> for ChartError {
    fn from(e: png::EncodingError) -> Self {
        ChartError::Encode(e)
    }
}

/// An 8-bit RGB colour.
pub type Rgb = [u8; 3];

const BACKGROUND: Rgb = [255, 255, 255];
const INK: Rgb = [33, 33, 33];
const MUTED: Rgb = [130, 130, 130];
const GRID: Rgb = [228, 228, 228];
const AXIS: Rgb = [90, 90, 90];
const MEDIAN: Rgb = [0, 0, 0];
const TARGET: Rgb = [214, 39, 40];
/// Tableau-like colours, red left out because it marks the target.
const PALETTE: [Rgb; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [23, 190, 207],
];

// Layout, in pixels. The height grows with the rows so each chart stays small.
const WIDTH: u32 = 800;
const MARGIN: i32 = 16;
const TITLE_Y: i32 = 14;
const PLOT_TOP: i32 = 48;
const ROW_HEIGHT: i32 = 60;
/// Below the rows: tick marks, tick labels and the unit.
const FOOTER: i32 = 72;
/// Text is drawn at twice the font's size: 1x is too small to read in a report.
const SCALE: i32 = 2;
const LABEL_CHARS: usize = 18;
const LABEL_LINES: usize = 2;
const PLOT_LEFT: i32 = MARGIN + LABEL_CHARS as i32 * ADVANCE * SCALE + MARGIN;
/// Room right of the axis for the last tick label (distribution) or for the value
/// printed after the longest bar.
const RIGHT_ROOM_DISTRIBUTION: i32 = 40;
const RIGHT_ROOM_BARS: i32 = 130;

/// Renders box plots (min–max whisker, p25–p75 box, median line) with the samples
/// as jittered dots, one row per series, on a shared axis from 0. Non-finite
/// samples are skipped; a series left empty reads "no data".
pub fn distribution_chart(
    title: &str,
    unit: &str,
    series: &[Series],
) -> Result<Vec<u8>, ChartError> {
    let cleaned: Vec<Vec<f64>> = series.iter().map(|s| finite_sorted(&s.samples)).collect();
    let max = cleaned
        .iter()
        .filter_map(|s| s.last())
        .copied()
        .fold(None, max_of);
    let Some(max) = max else {
        return Err(ChartError::NoData);
    };
    let layout = Layout::new(series.len(), RIGHT_ROOM_DISTRIBUTION, max);
    let mut canvas = layout.canvas();
    draw_frame(&mut canvas, &layout, title, unit);
    for (row, (s, sorted)) in series.iter().zip(&cleaned).enumerate() {
        let colour = PALETTE[row % PALETTE.len()];
        draw_row_label(&mut canvas, &layout, row, &s.label);
        match spread(sorted) {
            Some(sp) => {
                draw_box(&mut canvas, &layout, row, &sp, colour);
                draw_dots(&mut canvas, &layout, row, &s.samples, colour);
            }
            None => {
                let y = layout.row_top(row) + ROW_HEIGHT / 2 - glyph_height() / 2;
                canvas.text(PLOT_LEFT + 8, y, "no data", SCALE, MUTED);
            }
        }
    }
    canvas.to_png()
}

/// Renders one horizontal bar per entry on a shared axis from 0, the value and unit
/// printed at the bar's end, and a dashed "target" marker where `reference` is set.
/// Bars whose value is not finite are left out; negative values draw as 0.
pub fn bar_chart(title: &str, unit: &str, bars: &[Bar]) -> Result<Vec<u8>, ChartError> {
    let bars: Vec<&Bar> = bars.iter().filter(|b| b.value.is_finite()).collect();
    let references = bars
        .iter()
        .filter_map(|b| b.reference)
        .filter(|r| r.is_finite());
    let max = bars
        .iter()
        .map(|b| b.value)
        .chain(references)
        .fold(None, max_of);
    let Some(max) = max else {
        return Err(ChartError::NoData);
    };
    let layout = Layout::new(bars.len(), RIGHT_ROOM_BARS, max);
    let mut canvas = layout.canvas();
    draw_frame(&mut canvas, &layout, title, unit);
    for (row, bar) in bars.iter().enumerate() {
        let colour = PALETTE[row % PALETTE.len()];
        draw_row_label(&mut canvas, &layout, row, &bar.label);
        draw_bar(&mut canvas, &layout, row, bar.value, colour);
        if let Some(reference) = bar.reference.filter(|r| r.is_finite()) {
            draw_target(&mut canvas, &layout, row, reference);
        }
        // Last, on a backing of its own, so a target line through it cannot hide it.
        draw_bar_value(&mut canvas, &layout, row, bar.value, unit, colour);
    }
    canvas.to_png()
}

fn max_of(acc: Option<f64>, v: f64) -> Option<f64> {
    Some(acc.map_or(v, |a| a.max(v)))
}

/// The finite samples, ascending: NaN and infinities would poison every statistic.
fn finite_sorted(samples: &[f64]) -> Vec<f64> {
    let mut sorted: Vec<f64> = samples.iter().copied().filter(|s| s.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    sorted
}

/// The five numbers a box plot draws.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Spread {
    min: f64,
    p25: f64,
    median: f64,
    p75: f64,
    max: f64,
}

/// The five numbers of `sorted` (ascending), `None` when it is empty.
fn spread(sorted: &[f64]) -> Option<Spread> {
    let (&min, &max) = (sorted.first()?, sorted.last()?);
    Some(Spread {
        min,
        p25: quantile(sorted, 0.25),
        median: quantile(sorted, 0.5),
        p75: quantile(sorted, 0.75),
        max,
    })
}

/// Linear interpolation between closest ranks, so the median of an even count is
/// the mean of the middle two, as in `stats::median`.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Axis ticks from 0 with a 1/2/5×10^k step, about five of them (four to seven),
/// the last one at or above `max`.
#[derive(Debug, Clone, PartialEq)]
struct Ticks {
    step: f64,
    values: Vec<f64>,
}

fn nice_ticks(max: f64) -> Ticks {
    // An all-zero chart still needs a non-degenerate axis.
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 4.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = magnitude * nice_mantissa(raw / magnitude);
    // The epsilon keeps a max that is a multiple of the step (150) from adding one.
    let count = (max / step - 1e-9).ceil().max(1.0) as usize;
    let values = (0..=count).map(|i| i as f64 * step).collect();
    Ticks { step, values }
}

/// Rounds a mantissa in [1, 10) to the nearest of 1, 2, 5, 10.
fn nice_mantissa(m: f64) -> f64 {
    match m {
        m if m < 1.5 => 1.0,
        m if m < 3.0 => 2.0,
        m if m < 7.0 => 5.0,
        _ => 10.0,
    }
}

/// A tick label with just the decimals its step needs: 0.2 → "0.2", 50 → "50";
/// from a step of 10 000 up, with a k/M/G/T suffix so labels stay short
/// ("200M", not "200000000").
fn format_tick(value: f64, step: f64) -> String {
    if step >= 1e4 && value != 0.0 {
        let (divisor, suffix) = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
            .into_iter()
            .find(|&(d, _)| step >= d)
            .expect("step >= 1e4 has a suffix");
        return format!("{:.0}{suffix}", value / divisor);
    }
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10() - 1e-9).ceil() as usize
    };
    format!("{value:.decimals$}")
}

/// A bar's value with three significant figures or so: 1024, 45.7, 3.14.
fn format_value(value: f64, unit: &str) -> String {
    let number = if value.abs() >= 100.0 || value.fract() == 0.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    };
    if unit.is_empty() {
        number
    } else {
        format!("{number} {unit}")
    }
}

/// `s` cut to `max` characters, ending in "..." when cut.
fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    if max <= 3 {
        // No room for text and ellipsis: the text says more.
        return s.chars().take(max).collect();
    }
    let mut out: String = s.chars().take(max - 3).collect();
    out.push_str("...");
    out
}

/// Word-wraps `label` into at most `max_lines` lines of `max_chars`; what does not
/// fit ends the last line and is truncated with "...".
fn wrap_label(label: &str, max_chars: usize, max_lines: usize) -> Vec<String> {
    let words: Vec<&str> = label.split_whitespace().collect();
    let mut lines: Vec<String> = Vec::new();
    let mut current = String::new();
    for (i, word) in words.iter().enumerate() {
        let needed =
            current.chars().count() + usize::from(!current.is_empty()) + word.chars().count();
        if current.is_empty() || needed <= max_chars {
            if !current.is_empty() {
                current.push(' ');
            }
            current.push_str(word);
        } else if lines.len() + 1 >= max_lines {
            current = format!("{current} {}", words[i..].join(" "));
            break;
        } else {
            lines.push(std::mem::replace(&mut current, word.to_string()));
        }
    }
    if !current.is_empty() {
        lines.push(current);
    }
    lines.iter().map(|l| truncate(l, max_chars)).collect()
}

/// Where things go on a chart of `rows` rows whose axis ends at the last tick.
struct Layout {
    rows: usize,
    plot_right: i32,
    ticks: Ticks,
}

impl Layout {
    fn new(rows: usize, right_room: i32, max: f64) -> Self {
        Layout {
            rows,
            plot_right: WIDTH as i32 - right_room,
            ticks: nice_ticks(max),
        }
    }

    fn height(&self) -> u32 {
        (PLOT_TOP + ROW_HEIGHT * self.rows as i32 + FOOTER) as u32
    }

    fn canvas(&self) -> Canvas {
        Canvas::new(WIDTH, self.height(), BACKGROUND)
    }

    fn plot_bottom(&self) -> i32 {
        PLOT_TOP + ROW_HEIGHT * self.rows as i32
    }

    fn row_top(&self, row: usize) -> i32 {
        PLOT_TOP + ROW_HEIGHT * row as i32
    }

    fn axis_max(&self) -> f64 {
        *self
            .ticks
            .values
            .last()
            .expect("nice_ticks returns at least two ticks")
    }

    /// The pixel column of `value`, clamped to the plot: the axis starts at 0.
    fn x_of(&self, value: f64) -> i32 {
        let fraction = (value / self.axis_max()).clamp(0.0, 1.0);
        PLOT_LEFT + (fraction * f64::from(self.plot_right - PLOT_LEFT)).round() as i32
    }
}

/// Title, vertical grid lines at the ticks, the axis with its labels and the unit.
fn draw_frame(canvas: &mut Canvas, layout: &Layout, title: &str, unit: &str) {
    let title_chars = ((WIDTH as i32 - 2 * MARGIN) / (ADVANCE * SCALE)) as usize;
    canvas.text(MARGIN, TITLE_Y, &truncate(title, title_chars), SCALE, INK);
    let bottom = layout.plot_bottom();
    let labels: Vec<String> = layout
        .ticks
        .values
        .iter()
        .map(|&t| format_tick(t, layout.ticks.step))
        .collect();
    let every = tick_label_stride(layout, &labels);
    for (i, (&tick, label)) in layout.ticks.values.iter().zip(&labels).enumerate() {
        let x = layout.x_of(tick);
        canvas.line(x, PLOT_TOP, x, bottom, GRID);
        canvas.line(x, bottom, x, bottom + 5, AXIS);
        if i % every == 0 {
            let w = text_width(label, SCALE);
            canvas.text(x - w / 2, bottom + 10, label, SCALE, INK);
        }
    }
    canvas.line(PLOT_LEFT, bottom, layout.plot_right, bottom, AXIS);
    canvas.line(PLOT_LEFT, PLOT_TOP, PLOT_LEFT, bottom, AXIS);
    if !unit.is_empty() {
        let w = text_width(unit, SCALE);
        let centre = (PLOT_LEFT + layout.plot_right) / 2;
        canvas.text(centre - w / 2, bottom + 38, unit, SCALE, INK);
    }
}

/// 1 to label every tick, 2 for every other one when the widest label would touch
/// its neighbours (long decimals on a narrow axis), and so on.
fn tick_label_stride(layout: &Layout, labels: &[String]) -> usize {
    let widest = labels
        .iter()
        .map(|l| text_width(l, SCALE))
        .max()
        .unwrap_or(0);
    let spacing = (layout.plot_right - PLOT_LEFT) / (labels.len() as i32 - 1).max(1);
    let mut stride = 1;
    while spacing * (stride as i32) < widest + 8 && stride < labels.len() {
        stride += 1;
    }
    stride
}

/// The row's label, right-aligned against the plot and centred on the row.
fn draw_row_label(canvas: &mut Canvas, layout: &Layout, row: usize, label: &str) {
    let lines = wrap_label(label, LABEL_CHARS, LABEL_LINES);
    let line_height = glyph_height() + 4;
    let block = line_height * lines.len() as i32 - 4;
    let mut y = layout.row_top(row) + (ROW_HEIGHT - block) / 2;
    for line in &lines {
        let w = text_width(line, SCALE);
        canvas.text(PLOT_LEFT - MARGIN / 2 - w, y, line, SCALE, INK);
        y += line_height;
    }
}

// A distribution row: the box in the upper part, the dots in a strip below it, so
// neither hides the other.
const BOX_CENTRE: i32 = 20;
const BOX_HALF: i32 = 11;
const DOTS_TOP: i32 = 38;
const DOTS_BAND: i32 = 16;

fn draw_box(canvas: &mut Canvas, layout: &Layout, row: usize, sp: &Spread, colour: Rgb) {
    let cy = layout.row_top(row) + BOX_CENTRE;
    let (x_min, x_max) = (layout.x_of(sp.min), layout.x_of(sp.max));
    let (x25, x75) = (layout.x_of(sp.p25), layout.x_of(sp.p75));
    // Whisker and end caps: 2 px so they survive scaling in a viewer.
    canvas.fill_rect(x_min, cy - 1, x_max - x_min + 1, 2, colour);
    canvas.fill_rect(x_min - 1, cy - 6, 2, 12, colour);
    canvas.fill_rect(x_max - 1, cy - 6, 2, 12, colour);
    // The box: tinted fill, solid outline; at least 3 px wide so a zero IQR shows.
    let (left, width) = (x25 - 1, (x75 - x25 + 3).max(3));
    canvas.fill_rect(left, cy - BOX_HALF, width, 2 * BOX_HALF + 1, colour);
    canvas.fill_rect(
        left + 2,
        cy - BOX_HALF + 2,
        width - 4,
        2 * BOX_HALF - 3,
        tint(colour),
    );
    let x_med = layout.x_of(sp.median);
    canvas.fill_rect(x_med - 1, cy - BOX_HALF - 3, 3, 2 * BOX_HALF + 7, MEDIAN);
}

/// Each sample as a small disc, spread vertically by the golden-ratio sequence:
/// deterministic, and no two nearby samples land on the same height.
fn draw_dots(canvas: &mut Canvas, layout: &Layout, row: usize, samples: &[f64], colour: Rgb) {
    let top = layout.row_top(row) + DOTS_TOP;
    for (i, &s) in samples.iter().filter(|s| s.is_finite()).enumerate() {
        let jitter = ((i as f64 * 0.618_034 + 0.5).fract() * f64::from(DOTS_BAND)) as i32;
        canvas.disc(layout.x_of(s), top + jitter, colour);
    }
}

const BAR_HALF: i32 = 13;

fn bar_centre(layout: &Layout, row: usize) -> i32 {
    // Below the row's middle, to leave room above for the "target" label.
    layout.row_top(row) + ROW_HEIGHT / 2 + 4
}

/// Pixel width of a bar: even a zero bar gets a sliver, so the row does not look
/// missing.
fn bar_width(layout: &Layout, value: f64) -> i32 {
    (layout.x_of(value) - PLOT_LEFT).max(2)
}

fn draw_bar(canvas: &mut Canvas, layout: &Layout, row: usize, value: f64, colour: Rgb) {
    let cy = bar_centre(layout, row);
    canvas.fill_rect(
        PLOT_LEFT,
        cy - BAR_HALF,
        bar_width(layout, value),
        2 * BAR_HALF,
        colour,
    );
}

/// The value and unit just past the bar's end, or inside the bar in white when the
/// canvas ends first.
fn draw_bar_value(
    canvas: &mut Canvas,
    layout: &Layout,
    row: usize,
    value: f64,
    unit: &str,
    colour: Rgb,
) {
    let text = format_value(value, unit);
    let w = text_width(&text, SCALE);
    let h = glyph_height();
    let y = bar_centre(layout, row) - h / 2 + 1;
    let end = PLOT_LEFT + bar_width(layout, value);
    let (x, backing, ink) = if end + 8 + w <= WIDTH as i32 - 4 {
        (end + 8, BACKGROUND, INK)
    } else {
        (end - 8 - w, colour, BACKGROUND)
    };
    canvas.fill_rect(x - 3, y - 2, w + 6, h + 2, backing);
    canvas.text(x, y, &text, SCALE, ink);
}

/// A dashed vertical line across the row at `reference`, labelled "target" above
/// the bar.
fn draw_target(canvas: &mut Canvas, layout: &Layout, row: usize, reference: f64) {
    let x = layout.x_of(reference);
    let top = layout.row_top(row);
    let mut y = top + 2;
    while y < top + ROW_HEIGHT - 2 {
        canvas.fill_rect(x - 1, y, 3, 5, TARGET);
        y += 9;
    }
    let label = "target";
    let w = text_width(label, SCALE);
    let lx = if x + 6 + w <= WIDTH as i32 - 4 {
        x + 6
    } else {
        x - 6 - w
    };
    canvas.text(lx, top + 1, label, SCALE, TARGET);
}

/// `c` mixed 70 % towards white: the box fill, light enough for the median to show.
fn tint(c: Rgb) -> Rgb {
    c.map(|v| (u16::from(v) * 3 / 10 + 255 * 7 / 10) as u8)
}

/// An RGB raster, row-major, 3 bytes a pixel.
#[derive(Debug, Clone, PartialEq)]
pub struct Canvas {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

impl Canvas {
    pub fn new(width: u32, height: u32, background: Rgb) -> Self {
        let pixels = background.repeat((width * height) as usize);
        Canvas {
            width,
            height,
            pixels,
        }
    }

    /// The colour at (x, y), `None` outside the canvas.
    pub fn pixel(&self, x: i32, y: i32) -> Option<Rgb> {
        let i = self.index(x, y)?;
        Some([self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]])
    }

    /// Sets one pixel; anything outside the canvas is clipped, so callers need not.
    pub fn put(&mut self, x: i32, y: i32, colour: Rgb) {
        if let Some(i) = self.index(x, y) {
            self.pixels[i..i + 3].copy_from_slice(&colour);
        }
    }

    fn index(&self, x: i32, y: i32) -> Option<usize> {
        let (x, y) = (u32::try_from(x).ok()?, u32::try_from(y).ok()?);
        (x < self.width && y < self.height).then(|| ((y * self.width + x) * 3) as usize)
    }

    pub fn fill_rect(&mut self, x: i32, y: i32, w: i32, h: i32, colour: Rgb) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.put(xx, yy, colour);
            }
        }
    }

    /// A 1-px line from (x0, y0) to (x1, y1), both ends included (Bresenham).
    pub fn line(&mut self, x0: i32, y0: i32, x1: i32, y1: i32, colour: Rgb) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = ((x1 - x0).signum(), (y1 - y0).signum());
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.put(x, y, colour);
            if x == x1 && y == y1 {
                return;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// A filled disc of radius 2 centred on (x, y): a 5x5 square without corners.
    pub fn disc(&mut self, x: i32, y: i32, colour: Rgb) {
        self.fill_rect(x - 1, y - 2, 3, 5, colour);
        self.fill_rect(x - 2, y - 1, 5, 3, colour);
    }

    /// Draws `s` with its top-left corner at (x, y), each font pixel as a
    /// `scale`×`scale` square; characters outside ASCII 32..=126 draw as '?'.
    pub fn text(&mut self, x: i32, y: i32, s: &str, scale: i32, colour: Rgb) {
        for (n, c) in s.chars().enumerate() {
            let origin = x + n as i32 * ADVANCE * scale;
            for (row, bits) in glyph(c).iter().enumerate() {
                for col in 0..GLYPH_WIDTH {
                    if bits & (0x10 >> col) != 0 {
                        let (px, py) = (origin + col * scale, y + row as i32 * scale);
                        self.fill_rect(px, py, scale, scale, colour);
                    }
                }
            }
        }
    }

    /// Encodes as an 8-bit RGB PNG.
    pub fn to_png(&self) -> Result<Vec<u8>, ChartError> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.width, self.height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        // Flat colours compress well with Paeth and the best level: ~4 KB a chart
        // instead of ~30 KB with the defaults.
        encoder.set_compression(png::Compression::Best);
        encoder.set_filter(png::FilterType::Paeth);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&self.pixels)?;
        writer.finish()?;
        Ok(out)
    }
}

/// Width in pixels of `s` drawn at `scale`, without the gap after the last glyph.
pub fn text_width(s: &str, scale: i32) -> i32 {
    let n = s.chars().count() as i32;
    (n * ADVANCE - 1).max(0) * scale
}

/// Height of a line of text at [`SCALE`], descenders included.
fn glyph_height() -> i32 {
    FONT[0].len() as i32 * SCALE
}

const GLYPH_WIDTH: i32 = 5;
/// Glyph width plus one column of spacing.
const ADVANCE: i32 = GLYPH_WIDTH + 1;

fn glyph(c: char) -> &'static [u8; 8] {
    let code = c as u32;
    let index = if (32..=126).contains(&code) {
        code - 32
    } else {
        '?' as u32 - 32
    };
    &FONT[index as usize]
}

/// 5x8 glyphs for ASCII 32..=126, one byte a row from the top, bit 4 the leftmost
/// column. Rows 0-6 are the cap height; row 7 holds the descenders of g, j, p, q, y.
#[rustfmt::skip]
const FONT: [[u8; 8]; 95] = [
    [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00], // ' '
    [0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04, 0x00], // '!'
    [0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00, 0x00], // '"'
    [0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A, 0x00], // '#'
    [0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04, 0x00], // '$'
    [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03, 0x00], // '%'
    [0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D, 0x00], // '&'
    [0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00], // '\''
    [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02, 0x00], // '('
    [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08, 0x00], // ')'
    [0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00, 0x00], // '*'
    [0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00, 0x00], // '+'
    [0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08], // ','
    [0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00, 0x00], // '-'
    [0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C, 0x00], // '.'
    [0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00, 0x00], // '/'
    [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E, 0x00], // '0'
    [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00], // '1'
    [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F, 0x00], // '2'
    [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E, 0x00], // '3'
    [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02, 0x00], // '4'
    [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E, 0x00], // '5'
    [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E, 0x00], // '6'
    [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08, 0x00], // '7'
    [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E, 0x00], // '8'
    [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C, 0x00], // '9'
    [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00, 0x00], // ':'
    [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08, 0x00], // ';'
    [0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02, 0x00], // '<'
    [0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00, 0x00], // '='
    [0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08, 0x00], // '>'
    [0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04, 0x00], // '?'
    [0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E, 0x00], // '@'
    [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11, 0x00], // 'A'
    [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E, 0x00], // 'B'
    [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E, 0x00], // 'C'
    [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C, 0x00], // 'D'
    [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F, 0x00], // 'E'
    [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10, 0x00], // 'F'
    [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F, 0x00], // 'G'
    [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11, 0x00], // 'H'
    [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00], // 'I'
    [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C, 0x00], // 'J'
    [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11, 0x00], // 'K'
    [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F, 0x00], // 'L'
    [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11, 0x00], // 'M'
    [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11, 0x00], // 'N'
    [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E, 0x00], // 'O'
    [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10, 0x00], // 'P'
    [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D, 0x00], // 'Q'
    [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11, 0x00], // 'R'
    [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E, 0x00], // 'S'
    [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00], // 'T'
    [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E, 0x00], // 'U'
    [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04, 0x00], // 'V'
    [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A, 0x00], // 'W'
    [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11, 0x00], // 'X'
    [0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04, 0x00], // 'Y'
    [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F, 0x00], // 'Z'
    [0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E, 0x00], // '['
    [0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00, 0x00], // '\\'
    [0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E, 0x00], // ']'
    [0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00, 0x00], // '^'
    [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F, 0x00], // '_'
    [0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00], // '`'
    [0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F, 0x00], // 'a'
    [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E, 0x00], // 'b'
    [0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E, 0x00], // 'c'
    [0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F, 0x00], // 'd'
    [0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E, 0x00], // 'e'
    [0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08, 0x00], // 'f'
    [0x00, 0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E], // 'g'
    [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00], // 'h'
    [0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E, 0x00], // 'i'
    [0x02, 0x00, 0x06, 0x02, 0x02, 0x02, 0x12, 0x0C], // 'j'
    [0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12, 0x00], // 'k'
    [0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00], // 'l'
    [0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11, 0x00], // 'm'
    [0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00], // 'n'
    [0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E, 0x00], // 'o'
    [0x00, 0x00, 0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10], // 'p'
    [0x00, 0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x01], // 'q'
    [0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10, 0x00], // 'r'
    [0x00, 0x00, 0x0F, 0x10, 0x0E, 0x01, 0x1E, 0x00], // 's'
    [0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06, 0x00], // 't'
    [0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D, 0x00], // 'u'
    [0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04, 0x00], // 'v'
    [0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A, 0x00], // 'w'
    [0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x00], // 'x'
    [0x00, 0x00, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E], // 'y'
    [0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F, 0x00], // 'z'
    [0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02, 0x00], // '{'
    [0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00], // '|'
    [0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08, 0x00], // '}'
    [0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00, 0x00], // '~'
];

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> (png::OutputInfo, Canvas) {
        let decoder = png::Decoder::new(bytes);
        let mut reader = decoder.read_info().expect("PNG header");
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).expect("PNG frame");
        buf.truncate(info.buffer_size());
        let canvas = Canvas {
            width: info.width,
            height: info.height,
            pixels: buf,
        };
        (info, canvas)
    }

    fn series(label: &str, samples: &[f64]) -> Series {
        Series {
            label: label.to_string(),
            samples: samples.to_vec(),
        }
    }

    fn bar(label: &str, value: f64, reference: Option<f64>) -> Bar {
        Bar {
            label: label.to_string(),
            value,
            reference,
        }
    }

    #[test]
    fn png_signature_and_header() {
        let data = [
            series("vmctl", &[40.0, 42.5, 41.0]),
            series("qemu-microvm", &[90.0, 95.0]),
        ];
        let bytes = distribution_chart("Boot time", "ms", &data).unwrap();
        assert_eq!(
            &bytes[..8],
            &[0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A]
        );
        let (info, canvas) = decode(&bytes);
        assert_eq!((info.width, info.height), (800, 120 + 60 * 2));
        assert_eq!(
            (info.color_type, info.bit_depth),
            (png::ColorType::Rgb, png::BitDepth::Eight)
        );
        assert_eq!(canvas.pixels.len(), 800 * 240 * 3);

        let bytes = bar_chart("Memory", "MiB", &[bar("vmctl", 30.0, None)]).unwrap();
        let (info, _) = decode(&bytes);
        assert_eq!((info.width, info.height), (800, 180));
    }

    #[test]
    fn box_and_median_land_where_expected() {
        let data = [series("known", &[10.0, 20.0, 30.0, 40.0, 50.0])];
        let (_, canvas) = decode(&distribution_chart("t", "ms", &data).unwrap());
        let layout = Layout::new(1, RIGHT_ROOM_DISTRIBUTION, 50.0);
        assert_eq!(layout.axis_max(), 50.0);
        // Off the whisker (cy ± 1) but inside the box.
        let y = layout.row_top(0) + BOX_CENTRE + 5;
        let colour = PALETTE[0];
        assert_eq!(
            canvas.pixel(layout.x_of(30.0), y),
            Some(MEDIAN),
            "median line at 30"
        );
        assert_eq!(
            canvas.pixel(layout.x_of(25.0), y),
            Some(tint(colour)),
            "box fill, p25..p75"
        );
        assert_eq!(
            canvas.pixel(layout.x_of(35.0), y),
            Some(tint(colour)),
            "box fill, p25..p75"
        );
        assert_eq!(
            canvas.pixel(layout.x_of(15.0), y),
            Some(BACKGROUND),
            "outside the box"
        );
        assert_eq!(
            canvas.pixel(layout.x_of(45.0), y),
            Some(BACKGROUND),
            "outside the box"
        );
        let cy = layout.row_top(0) + BOX_CENTRE;
        assert_eq!(
            canvas.pixel(layout.x_of(15.0), cy),
            Some(colour),
            "whisker, min..p25"
        );
        assert_eq!(
            canvas.pixel(layout.x_of(45.0), cy),
            Some(colour),
            "whisker, p75..max"
        );
        // A dot for every sample: the smallest one in the strip below the box.
        let dots: Vec<i32> = (DOTS_TOP..DOTS_TOP + DOTS_BAND + 3)
            .filter(|dy| canvas.pixel(layout.x_of(10.0), layout.row_top(0) + dy) == Some(colour))
            .collect();
        assert!(!dots.is_empty(), "dot for the sample 10");
    }

    #[test]
    fn quantiles_interpolate() {
        let sp = spread(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(
            (sp.min, sp.p25, sp.median, sp.p75, sp.max),
            (1.0, 1.75, 2.5, 3.25, 4.0)
        );
        let one = spread(&[7.0]).unwrap();
        assert_eq!((one.min, one.median, one.max), (7.0, 7.0, 7.0));
        assert_eq!(spread(&[]), None);
    }

    #[test]
    fn nice_ticks_are_1_2_5_steps() {
        assert_eq!(nice_ticks(137.0).values, vec![0.0, 50.0, 100.0, 150.0]);
        assert_eq!(nice_ticks(150.0).values, vec![0.0, 50.0, 100.0, 150.0]);
        assert_eq!(
            nice_ticks(100.0).values,
            vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]
        );
        let t = nice_ticks(1024.0);
        assert_eq!(
            (t.step, t.values.len(), t.values.last()),
            (200.0, 7, Some(&1200.0))
        );
        for max in [0.003, 0.7, 1.0, 9.9, 42.0, 999.0, 1e6] {
            let t = nice_ticks(max);
            assert!((4..=7).contains(&t.values.len()), "{max}: {:?}", t.values);
            assert!(*t.values.last().unwrap() >= max);
        }
        // Degenerate input still gives a usable axis.
        assert_eq!(nice_ticks(0.0).values.last(), Some(&1.0));
        assert_eq!(nice_ticks(f64::NAN).values.last(), Some(&1.0));
        assert_eq!(format_tick(0.4 + 0.2, 0.2), "0.6");
        assert_eq!(format_tick(150.0, 50.0), "150");
        assert_eq!(format_tick(0.15, 0.05), "0.15");
        assert_eq!(format_tick(5000.0, 1000.0), "5000");
        assert_eq!(format_tick(60_000.0, 20_000.0), "60k");
        assert_eq!(format_tick(1.2e9, 2e8), "1200M");
        assert_eq!(format_tick(0.0, 2e8), "0");
    }

    #[test]
    fn crowded_tick_labels_are_thinned() {
        let layout = Layout::new(1, RIGHT_ROOM_BARS, 100.0);
        let short: Vec<String> = ["0", "20", "40", "60", "80", "100"]
            .map(String::from)
            .to_vec();
        assert_eq!(tick_label_stride(&layout, &short), 1);
        let wide: Vec<String> = (0..6).map(|_| "0.000000000".to_string()).collect();
        assert!(tick_label_stride(&layout, &wide) >= 2);
    }

    #[test]
    fn values_format_with_unit() {
        assert_eq!(format_value(1024.0, "MiB"), "1024 MiB");
        assert_eq!(format_value(312.4, "MiB"), "312 MiB");
        assert_eq!(format_value(45.67, "ms"), "45.7 ms");
        assert_eq!(format_value(4.567, ""), "4.57");
        assert_eq!(format_value(0.0, "MiB"), "0 MiB");
    }

    #[test]
    fn labels_wrap_and_truncate() {
        assert_eq!(truncate("vmctl", 18), "vmctl");
        assert_eq!(truncate("abcdefghij", 8), "abcde...");
        assert_eq!(truncate("abcdefghij", 2), "ab");
        assert_eq!(truncate("ééééé", 4), "é...");
        assert_eq!(wrap_label("vmctl", 18, 2), vec!["vmctl"]);
        assert_eq!(
            wrap_label("Docker Sandboxes documented", 18, 2),
            vec!["Docker Sandboxes", "documented"]
        );
        let long = wrap_label("a very long label that goes on and on and on", 18, 2);
        assert_eq!(long, vec!["a very long label", "that goes on an..."]);
        let word = wrap_label("supercalifragilisticexpialidocious", 18, 2);
        assert_eq!(word, vec!["supercalifragil..."]);
        assert!(wrap_label("", 18, 2).is_empty());
        // A label of any length still renders.
        let data = [series(&"x".repeat(500), &[1.0])];
        assert!(distribution_chart(&"title ".repeat(100), "ms", &data).is_ok());
    }

    #[test]
    fn non_finite_samples_are_skipped() {
        let data = [series(
            "a",
            &[f64::NAN, 10.0, f64::INFINITY, 20.0, f64::NEG_INFINITY],
        )];
        let clean = [series("a", &[10.0, 20.0])];
        assert_eq!(
            distribution_chart("t", "ms", &data).unwrap(),
            distribution_chart("t", "ms", &clean).unwrap()
        );
        let none = [series("a", &[f64::NAN]), series("b", &[f64::INFINITY])];
        assert!(matches!(
            distribution_chart("t", "ms", &none),
            Err(ChartError::NoData)
        ));
        // One series without data beside one with: drawn, marked "no data".
        let partial = [series("a", &[f64::NAN]), series("b", &[5.0])];
        assert!(distribution_chart("t", "ms", &partial).is_ok());
        let bars = [bar("a", f64::NAN, Some(1.0)), bar("b", 3.0, Some(f64::NAN))];
        let (info, _) = decode(&bar_chart("t", "MiB", &bars).unwrap());
        assert_eq!(info.height, 120 + 60, "the NaN bar is left out");
        let bars = [bar("a", f64::NAN, Some(1.0))];
        assert!(matches!(
            bar_chart("t", "MiB", &bars),
            Err(ChartError::NoData)
        ));
    }

    #[test]
    fn no_data_is_an_error() {
        assert!(matches!(
            distribution_chart("t", "ms", &[]),
            Err(ChartError::NoData)
        ));
        let empty = [series("a", &[])];
        assert!(matches!(
            distribution_chart("t", "ms", &empty),
            Err(ChartError::NoData)
        ));
        assert!(matches!(
            bar_chart("t", "MiB", &[]),
            Err(ChartError::NoData)
        ));
        assert_eq!(ChartError::NoData.to_string(), "no finite data to plot");
    }

    #[test]
    fn degenerate_data_renders() {
        for samples in [
            &[42.0][..],
            &[5.0; 10][..],
            &[0.0, 0.0][..],
            &[-3.0, 1.0][..],
        ] {
            let data = [series("a", samples)];
            assert!(distribution_chart("t", "ms", &data).is_ok(), "{samples:?}");
        }
        let zeros = [
            bar("a", 0.0, None),
            bar("b", 0.0, Some(0.0)),
            bar("c", -1.0, None),
        ];
        assert!(bar_chart("t", "MiB", &zeros).is_ok());
        // A bar too long for its value text puts it inside, in white.
        let huge = [bar("a", 1.0e12, None)];
        assert!(bar_chart("t", "bytes", &huge).is_ok());
    }

    #[test]
    fn target_marker_is_dashed_at_reference() {
        let bars = [bar("vmctl", 300.0, Some(512.0))];
        let (_, canvas) = decode(&bar_chart("t", "MiB", &bars).unwrap());
        let layout = Layout::new(1, RIGHT_ROOM_BARS, 512.0);
        let x = layout.x_of(512.0);
        let column: Vec<bool> = (layout.row_top(0)..layout.row_top(0) + ROW_HEIGHT)
            .map(|y| canvas.pixel(x, y) == Some(TARGET))
            .collect();
        let on = column.iter().filter(|&&on| on).count();
        assert!(
            on > 15 && on < ROW_HEIGHT as usize - 15,
            "dashed, not solid: {on}"
        );
        // The bar ends at its value.
        let y = layout.row_top(0) + ROW_HEIGHT / 2;
        assert_eq!(canvas.pixel(layout.x_of(300.0) - 1, y), Some(PALETTE[0]));
        assert_eq!(canvas.pixel(layout.x_of(300.0) + 3, y), Some(BACKGROUND));
    }

    #[test]
    fn output_is_deterministic_and_small() {
        let samples: Vec<f64> = (0..50).map(|i| 40.0 + f64::from(i % 7) * 1.5).collect();
        let data = [series("vmctl", &samples), series("qemu-microvm", &samples)];
        let a = distribution_chart("Boot time to init", "ms", &data).unwrap();
        let b = distribution_chart("Boot time to init", "ms", &data).unwrap();
        assert_eq!(a, b);
        assert!(a.len() < 50_000, "{} bytes", a.len());
    }

    #[test]
    fn font_covers_printable_ascii() {
        for code in 33u8..=126 {
            let c = char::from(code);
            assert!(glyph(c).iter().any(|&row| row != 0), "{c:?} is blank");
            assert!(glyph(c).iter().all(|&row| row < 0x20), "{c:?} wider than 5");
        }
        assert!(glyph(' ').iter().all(|&row| row == 0));
        assert_eq!(glyph('µ'), glyph('?'));
        // Descenders only where they belong.
        for c in (33u8..=126)
            .map(char::from)
            .filter(|c| !"gjpqy,".contains(*c))
        {
            assert_eq!(glyph(c)[7], 0, "{c:?}");
        }
        let mut canvas = Canvas::new(20, 20, BACKGROUND);
        canvas.text(0, 0, "1", 2, INK);
        assert_eq!(canvas.pixel(4, 0), Some(INK), "top of the 1's stem");
        assert_eq!(canvas.pixel(0, 0), Some(BACKGROUND));
        assert_eq!(text_width("ab", 2), 22);
        assert_eq!(text_width("", 2), 0);
    }
}
