//! A small ordered parallel map over scoped threads, for quantizing the tensors of one shard on
//! every core while the caller (progress display) stays on the calling thread.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

/// Runs `f(0..n)` on up to `available_parallelism` threads, calls `done(i, &result)` on the
/// calling thread as each finishes, and returns the results in index order.
///
/// On errors, no new index is started and the error of the lowest failed index is returned
/// (indices are taken in order, so that is the first error a sequential loop would meet).
pub(crate) fn map<T, E, F>(n: usize, f: F, mut done: impl FnMut(usize, &T)) -> Result<Vec<T>, E>
where
    T: Send,
    E: Send,
    F: Fn(usize) -> Result<T, E> + Sync,
{
    let threads = std::thread::available_parallelism()
        .map_or(1, |p| p.get())
        .min(n)
        .max(1);
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let mut results: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut first_err: Option<(usize, E)> = None;
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<(usize, Result<T, E>)>();
        for _ in 0..threads {
            let tx = tx.clone();
            let (next, stop, f) = (&next, &stop, &f);
            scope.spawn(move || loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                if r.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                if tx.send((i, r)).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        for (i, r) in rx {
            match r {
                Ok(v) => {
                    if first_err.is_none() {
                        done(i, &v);
                    }
                    results[i] = Some(v);
                }
                Err(e) => {
                    if first_err.as_ref().is_none_or(|(j, _)| i < *j) {
                        first_err = Some((i, e));
                    }
                }
            }
        }
    });
    match first_err {
        Some((_, e)) => Err(e),
        None => Ok(results
            .into_iter()
            .map(|r| r.expect("every index ran"))
            .collect()),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ordered_results_and_lowest_error() {
        let mut seen = Vec::new();
        let out = super::map(50, |i| Ok::<_, ()>(i * 2), |i, v| seen.push((i, *v))).unwrap();
        assert_eq!(out, (0..50).map(|i| i * 2).collect::<Vec<_>>());
        seen.sort();
        assert_eq!(seen.len(), 50);
        let err = super::map(50, |i| if i % 7 == 3 { Err(i) } else { Ok(i) }, |_, _| {});
        assert_eq!(err, Err(3));
    }
}
