//! For tests that compare an estimate of memory with what the code really holds: the system
//! allocator, counting what each thread holds and the most it held. A test binary installs it
//! with `#[global_allocator] static COUNTING: Counting = Counting;` (feature `counting`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// Bytes this thread has allocated and not freed, and the most it has held since reset.
    static HELD: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn held(delta: i64) {
    let _ = HELD.try_with(|h| {
        h.set(h.get() + delta);
        let _ = PEAK.try_with(|p| p.set(p.get().max(h.get())));
    });
}

pub struct Counting;

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        held(l.size() as i64);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        held(-(l.size() as i64));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, size: usize) -> *mut u8 {
        held(size as i64 - l.size() as i64);
        unsafe { System.realloc(p, l, size) }
    }
}

/// What `f` returns, and the heap it holds (allocated on this thread).
pub fn held_by<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = HELD.with(Cell::get);
    let value = f();
    let after = HELD.with(Cell::get);
    (value, (after - before).max(0) as u64)
}

/// The heap that the value `f` returns holds (allocated on this thread).
pub fn heap_of<T>(f: impl FnOnce() -> T) -> u64 {
    held_by(f).1
}

/// What `f` returns, and the most this thread held above what it held before, while `f` ran.
pub fn peak_of<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = HELD.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let value = f();
    (value, (PEAK.with(Cell::get) - before).max(0) as u64)
}
