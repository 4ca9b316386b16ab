//! Summary statistics of a sample: median, p90, min, max.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub median: f64,
    pub p90: f64,
    pub min: f64,
    pub max: f64,
}

/// A duration in milliseconds, the unit of the time figures.
pub fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `p`-th percentile (0 < p <= 100) by the nearest-rank method: the smallest
/// sample such that at least p % of the samples are <= it. With few samples (N = 10)
/// p90 is therefore the 9th smallest value, never an interpolation.
pub fn percentile_nearest_rank(sorted: &[f64], p: f64) -> f64 {
    assert!(!sorted.is_empty(), "percentile of an empty sample");
    assert!(p > 0.0 && p <= 100.0, "percentile {p} out of (0, 100]");
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median: the middle value, or the mean of the two middle values.
pub fn median(sorted: &[f64]) -> f64 {
    assert!(!sorted.is_empty(), "median of an empty sample");
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Median, nearest-rank p90, min and max of `samples` (any order); `None` if empty
/// or if a sample is not a finite number.
pub fn summarize(samples: &[f64]) -> Option<Summary> {
    if samples.is_empty() || samples.iter().any(|s| !s.is_finite()) {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    Some(Summary {
        median: median(&sorted),
        p90: percentile_nearest_rank(&sorted, 90.0),
        min: sorted[0],
        max: sorted[sorted.len() - 1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_and_even() {
        assert_eq!(median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
        assert_eq!(median(&[7.0]), 7.0);
    }

    #[test]
    fn p90_is_nearest_rank() {
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile_nearest_rank(&ten, 90.0), 9.0);
        assert_eq!(percentile_nearest_rank(&ten, 100.0), 10.0);
        assert_eq!(percentile_nearest_rank(&ten, 50.0), 5.0);
        // Three samples: ceil(2.7) = 3rd, the maximum.
        assert_eq!(percentile_nearest_rank(&[1.0, 2.0, 3.0], 90.0), 3.0);
        assert_eq!(percentile_nearest_rank(&[4.0], 90.0), 4.0);
        let eleven: Vec<f64> = (1..=11).map(f64::from).collect();
        assert_eq!(percentile_nearest_rank(&eleven, 90.0), 10.0);
    }

    #[test]
    fn summarize_sorts_and_rejects_bad_input() {
        let s = summarize(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!(
            s,
            Summary {
                median: 3.0,
                p90: 5.0,
                min: 1.0,
                max: 5.0
            }
        );
        assert!(summarize(&[]).is_none());
        assert!(summarize(&[1.0, f64::NAN]).is_none());
    }
}
