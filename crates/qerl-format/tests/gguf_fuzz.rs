//! Seeded fuzzing of the GGUF importer: thousands of mutations of a small synthetic model
//! (bit flips, overwritten counts and lengths, cuts, splices) must each convert or fail with a
//! `GgufError`: never a panic, and never an allocation much larger than the file (a counting
//! allocator records the largest single request).

mod gguf_common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use qerl_format::gguf::{convert_gguf, ConvertOptions, GgufFile};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The system allocator, remembering the largest allocation asked for.
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Values that make counts and lengths lie.
const NASTY: [u64; 8] = [
    0,
    1,
    0xff,
    0xffff,
    0xffff_ffff,
    1 << 40,
    u64::MAX / 2,
    u64::MAX,
];

fn mutate(rng: &mut StdRng, good: &[u8]) -> Vec<u8> {
    let mut bytes = good.to_vec();
    // Mostly the header (where the lengths are), sometimes anywhere.
    for _ in 0..rng.random_range(1..4) {
        let span = if rng.random_bool(0.8) {
            4096.min(bytes.len())
        } else {
            bytes.len()
        };
        let at = rng.random_range(0..span);
        match rng.random_range(0..5) {
            0 => bytes[at] ^= 1 << rng.random_range(0..8),
            1 => bytes[at] = rng.random(),
            2 => {
                let v = NASTY[rng.random_range(0..NASTY.len())].to_le_bytes();
                let n = if rng.random_bool(0.5) { 8 } else { 4 };
                let end = (at + n).min(bytes.len());
                bytes[at..end].copy_from_slice(&v[..end - at]);
            }
            3 => bytes.truncate(at),
            _ => {
                let from = rng.random_range(0..bytes.len());
                let n = rng.random_range(1..64).min(bytes.len() - from);
                let chunk = bytes[from..from + n].to_vec();
                bytes.splice(at..at, chunk);
            }
        }
        if bytes.is_empty() {
            break;
        }
    }
    bytes
}

#[test]
fn mutated_files_never_panic_or_over_allocate() {
    let (good, _, _) = gguf_common::tiny_llama();
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(21);
    let (mut parsed, mut converted) = (0, 0);
    let iterations = 3000;
    for i in 0..iterations {
        let bytes = mutate(&mut rng, &good);
        let file = std::panic::catch_unwind(|| {
            GgufFile::from_bytes("fuzz.gguf".as_ref(), bytes.clone()).map(|_| ())
        });
        assert!(file.is_ok(), "iteration {i}: parsing panicked");
        if file.unwrap().is_err() {
            continue;
        }
        parsed += 1;
        // Parsed: run the whole conversion (names, shapes, tokenizer, dequantization).
        if i % 3 == 0 {
            let gguf = tmp.path().join(format!("{i}.gguf"));
            std::fs::write(&gguf, &bytes).unwrap();
            let out = tmp.path().join(format!("out{i}"));
            let result = std::panic::catch_unwind(|| {
                convert_gguf(&gguf, &out, &ConvertOptions::default(), &|_| {}).is_ok()
            });
            assert!(result.is_ok(), "iteration {i}: conversion panicked");
            converted += result.unwrap() as usize;
            let _ = std::fs::remove_dir_all(&out);
            let _ = std::fs::remove_file(&gguf);
        }
    }
    let largest = LARGEST.load(Ordering::Relaxed);
    eprintln!(
        "{iterations} mutations: {parsed} parsed, {converted} converted; largest allocation {largest} bytes (file: {} bytes)",
        good.len()
    );
    assert!(
        parsed > 0 && parsed < iterations,
        "the mutations should hit both outcomes"
    );
    assert!(largest < 64 << 20, "an allocation of {largest} bytes");
}
