//! How a call's rows are cut into chunks for XLA's thread pool.
//!
//! The cut depends only on the shape, never on the number of threads, so every reduction over
//! chunks (the weight gradient) adds the same numbers in the same order on every run.

use xla_ffi_bundles::ffi::parallel::MAX_CHUNKS;

/// Elements per chunk the forward pass aims for: enough work to pay for a hand-off, and enough
/// rows for the software-pipelined loops (16 rows of 4096 measured better than 4).
pub const FORWARD_CHUNK_ELEMENTS: usize = 64 * 1024;
/// Elements per chunk the backward pass aims for. Each chunk starts with two dot products that
/// nothing overlaps and fills and later re-reads a float64 partial row, so chunks pay for
/// themselves later than the forward's: 4 chunks for 256x4096 or 64x16384 took fwd+bwd about
/// 10% less time than 16 (f32 and bf16, best and 10th-percentile times of 1500 calls, builds
/// alternated on an idle 2-core machine). Shapes of 4M elements and more still use
/// [`MAX_BACKWARD_CHUNKS`].
pub const BACKWARD_CHUNK_ELEMENTS: usize = 256 * 1024;
/// Most chunks (and so weight-gradient partial rows) a backward pass uses.
pub const MAX_BACKWARD_CHUNKS: usize = 16;

/// Contiguous ranges of items (rows or groups of rows): chunk `c` is `bounds[c]..bounds[c+1]`.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    bounds: [usize; MAX_CHUNKS + 1],
    count: usize,
}

impl Plan {
    /// Cuts `items` items of `item_elements` elements each into at most `max_chunks` balanced
    /// chunks of about `target` elements.
    pub fn split(items: usize, item_elements: usize, target: usize, max_chunks: usize) -> Plan {
        let mut bounds = [0usize; MAX_CHUNKS + 1];
        if items == 0 {
            return Plan { bounds, count: 0 };
        }
        let total = items.saturating_mul(item_elements.max(1));
        let wanted = total.div_ceil(target.max(1));
        let count = wanted.clamp(1, max_chunks.min(MAX_CHUNKS).min(items));
        for (c, b) in bounds.iter_mut().enumerate().take(count + 1) {
            *b = items * c / count;
        }
        Plan { bounds, count }
    }

    /// The backward pass's plan: chunk partial sums are re-read once each when they are added
    /// up, so it keeps chunks to at most one per 8 rows, and to `max_chunks`.
    pub fn backward(rows: usize, n: usize, max_chunks: usize) -> Plan {
        Plan::split(
            rows,
            n,
            BACKWARD_CHUNK_ELEMENTS,
            max_chunks.min((rows / 8).max(1)),
        )
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// The first item of chunk `c` (or the end, for `c == count`).
    pub fn start(&self, c: usize) -> usize {
        self.bounds[c]
    }

    /// The chunk boundaries, in items.
    pub fn bounds(&self) -> &[usize] {
        &self.bounds[..self.count + 1]
    }

    /// The chunk boundaries scaled to elements (`scale` elements per item).
    pub fn scaled(&self, scale: usize) -> [usize; MAX_CHUNKS + 1] {
        let mut out = [0usize; MAX_CHUNKS + 1];
        for (o, b) in out.iter_mut().zip(self.bounds()) {
            *o = b * scale;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_every_item_once() {
        for items in [0usize, 1, 2, 7, 8, 64, 65, 1000, 16384] {
            for n in [1usize, 128, 4096] {
                let p = Plan::split(items, n, FORWARD_CHUNK_ELEMENTS, MAX_CHUNKS);
                if items == 0 {
                    assert_eq!(p.count(), 0);
                    continue;
                }
                assert!(p.count() >= 1 && p.count() <= MAX_CHUNKS.min(items));
                assert_eq!(p.bounds()[0], 0);
                assert_eq!(*p.bounds().last().unwrap(), items);
                assert!(
                    p.bounds().windows(2).all(|w| w[0] < w[1]),
                    "{:?}",
                    p.bounds()
                );
                let b = Plan::backward(items, n, MAX_BACKWARD_CHUNKS);
                assert!(b.count() <= MAX_BACKWARD_CHUNKS);
            }
        }
        assert_eq!(
            Plan::split(8, 128, FORWARD_CHUNK_ELEMENTS, MAX_CHUNKS).count(),
            1
        );
        assert_eq!(
            Plan::split(256, 4096, FORWARD_CHUNK_ELEMENTS, MAX_CHUNKS).count(),
            16
        );
        // The stress harness's largest shapes (`rmsnorm_ffi.stress.SHAPES`) span several
        // backward chunks, so their weight gradients go through the partial rows.
        assert_eq!(Plan::backward(256, 4096, MAX_BACKWARD_CHUNKS).count(), 4);
        assert_eq!(Plan::backward(128, 4096, MAX_BACKWARD_CHUNKS).count(), 2);
        assert_eq!(Plan::backward(1024, 384, MAX_BACKWARD_CHUNKS).count(), 2);
    }
}
