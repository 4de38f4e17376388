//! Work on every core over scoped threads: an ordered parallel [`map`] (quantizing the tensors
//! of one shard while the caller, a progress display, stays on the calling thread; converting
//! the tensors of one decoder layer at load) and [`chunks`] (one large tensor split in equal
//! ranges, e.g. widening an embedding matrix).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

/// Threads to use: the cores this process may run on.
pub fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |p| p.get())
}

/// Runs `f` over `0..n` split into at most [`threads`] contiguous ranges, one thread each (on
/// the calling thread alone when `n` is small).
pub fn chunks(n: usize, f: impl Fn(Range<usize>) + Sync) {
    const MIN_PER_THREAD: usize = 1 << 14;
    let parts = threads().min(n / MIN_PER_THREAD).max(1);
    if parts == 1 {
        f(0..n);
        return;
    }
    let per = n.div_ceil(parts);
    std::thread::scope(|scope| {
        for start in (0..n).step_by(per) {
            let f = &f;
            scope.spawn(move || f(start..(start + per).min(n)));
        }
    });
}

/// Fills `out` from `input` on every core: `convert(start, input_chunk, out_chunk)` over
/// matching chunks, `ratio` input items per output item (e.g. 2 bytes per bf16 value), `start`
/// the index in `out` of the chunk's first item.
pub fn convert_into<I: Sync, O: Send>(
    input: &[I],
    ratio: usize,
    out: &mut [O],
    convert: impl Fn(usize, &[I], &mut [O]) + Sync,
) {
    assert_eq!(input.len(), out.len() * ratio, "convert_into: lengths");
    const MIN_PER_THREAD: usize = 1 << 16;
    let parts = threads().min(out.len() / MIN_PER_THREAD).max(1);
    if parts == 1 {
        convert(0, input, out);
        return;
    }
    let per = out.len().div_ceil(parts);
    std::thread::scope(|scope| {
        for (k, (i, o)) in input
            .chunks(per * ratio)
            .zip(out.chunks_mut(per))
            .enumerate()
        {
            let convert = &convert;
            scope.spawn(move || convert(k * per, i, o));
        }
    });
}

/// Runs `f(0..n)` on up to `available_parallelism` threads, calls `done(i, &result)` on the
/// calling thread as each finishes, and returns the results in index order.
///
/// On errors, no new index is started and the error of the lowest failed index is returned
/// (indices are taken in order, so that is the first error a sequential loop would meet).
pub fn map<T, E, F>(n: usize, f: F, mut done: impl FnMut(usize, &T)) -> Result<Vec<T>, E>
where
    T: Send,
    E: Send,
    F: Fn(usize) -> Result<T, E> + Sync,
{
    let threads = threads().min(n).max(1);
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

    #[test]
    fn chunks_and_convert_cover_every_item() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        for n in [0, 1, 100_000, 1_000_003] {
            let sum = AtomicUsize::new(0);
            super::chunks(n, |r| {
                sum.fetch_add(r.map(|i| i + 1).sum::<usize>(), Ordering::Relaxed);
            });
            assert_eq!(sum.into_inner(), n * (n + 1) / 2);
            let input: Vec<u16> = (0..2 * n).map(|i| i as u16).collect();
            let mut out = vec![0u32; n];
            super::convert_into(&input, 2, &mut out, |start, i, o| {
                for (j, (o, p)) in o.iter_mut().zip(i.chunks_exact(2)).enumerate() {
                    *o = p[0] as u32 + p[1] as u32 + (((start + j) as u32) << 20);
                }
            });
            let expect =
                |k: usize| (2 * k) as u16 as u32 + (2 * k + 1) as u16 as u32 + ((k as u32) << 20);
            assert!(out.iter().enumerate().all(|(k, &v)| v == expect(k)));
        }
    }
}
