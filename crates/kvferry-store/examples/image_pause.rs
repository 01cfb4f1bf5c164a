//! How long an HA leader's state lock is held while it takes an image of the whole state: what
//! a standby that links, or a snapshot of the etcd journal, costs every request of the
//! master. `OBJECTS` objects of 4 KiB spread over 16 clients' segments; the image taken in
//! one hold (`State::image`, as leaders did before) and in pieces (`State::image_head`, then
//! `State::image_piece` for each shard of the objects, as a leader's `Writer::image_in_pieces` takes them: it
//! lets the lock go once a hold reached 5 ms, so its longest hold is the longest run of
//! pieces below that plus one piece).
//!
//! `cargo run --release -p kvferry-store --example image_pause [objects] [rounds]`

use kvferry_store::master::changes::IMAGE_PIECES;
use std::time::Instant;

mod common;
use common::{counts, filled_state};

fn main() {
    let [objects, rounds] = counts("image_pause", [("objects", 1_000_000), ("rounds", 3)]);
    let (st, _) = filled_state(objects, true);
    for _ in 0..rounds {
        let t = Instant::now();
        let image = st.image(1);
        let held = t.elapsed();
        let n = image.len();
        let t = Instant::now();
        drop(image);
        println!("image of {n} changes in one hold: the state lock held {:.0} ms (freed after it, {:.0} ms)", held.as_secs_f64() * 1e3, t.elapsed().as_secs_f64() * 1e3);
        let (t, mut longest) = (Instant::now(), 0f64);
        let mut image = st.image_head(1);
        for i in 0..IMAGE_PIECES {
            let p = Instant::now();
            st.image_piece(i, 1, &mut image);
            longest = longest.max(p.elapsed().as_secs_f64());
        }
        println!("image of {} changes in {IMAGE_PIECES} pieces: {:.0} ms in all, the longest piece {:.1} ms", image.len(), t.elapsed().as_secs_f64() * 1e3, longest * 1e3);
    }
}
