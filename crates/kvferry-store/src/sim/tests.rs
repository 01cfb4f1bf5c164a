use super::*;
use std::fmt::Write as _;

/// Runs seed `seed`: its counts, and its trace's digest (the same seed gives the same one).
pub fn run(seed: u64) -> Result<(Counts, u64), Failure> {
    let mut sim = Sim::new(seed);
    for step in 0..STEPS {
        sim.step(step)?;
    }
    let _ = sim.leader.as_ref().map(|l| l.term);
    Ok((sim.counts, sim.digest))
}

/// Runs seed `seed` keeping every event: the events, and how the run ended.
pub fn run_traced(seed: u64) -> (Vec<String>, Result<(), String>) {
    let mut sim = Sim::new(seed);
    sim.full = Some(Vec::new());
    let mut end = Ok(());
    for step in 0..STEPS {
        if let Err(f) = sim.step(step) {
            end = Err(f.what);
            break;
        }
    }
    (sim.full.take().unwrap_or_default(), end)
}

/// A failure as the test prints it.
pub fn report(f: &Failure) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "simulation seed {} failed at step {}: {}",
        f.seed, f.step, f.what
    );
    let _ = writeln!(
        s,
        "replay it alone: KVFERRY_SIM_SEED={} cargo test -p kvferry-store --lib sim::",
        f.seed
    );
    let _ = writeln!(s, "last events:\n{}", f.trace);
    s
}

/// The seeds to run: `KVFERRY_SIM_SEED` alone, else `0..KVFERRY_SIM_SEEDS`.
fn seeds() -> Vec<u64> {
    let var = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    match var("KVFERRY_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (0..var("KVFERRY_SIM_SEEDS").unwrap_or(DEFAULT_SEEDS)).collect(),
    }
}

/// How long one seed may run on the wall clock before the test fails naming it: a seed that
/// hangs where the simulation's own budget ([`WORK`], the election's `POLLS_PER_TURN`) does
/// not look. A seed takes milliseconds; this is for a hang, not for a slow machine.
const SEED_WALL: std::time::Duration = std::time::Duration::from_secs(120);

/// Runs `f` over `seeds` on every CPU: each seed's result, in no particular order. A seed
/// that runs longer than [`SEED_WALL`] is `Err` naming it and how to replay it, as the last
/// result (its thread is left running: the test fails, and the test process ends with it).
pub fn run_seeds<T: Send + 'static>(
    seeds: &[u64],
    f: fn(u64) -> Result<T, String>,
) -> Vec<Result<T, String>> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{mpsc, Arc};
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(seeds.len().max(1));
    let started = std::time::Instant::now();
    // Per thread: the seed it runs and since when (ms from `started`; u64::MAX: none).
    let running: Arc<Vec<(AtomicU64, AtomicU64)>> = Arc::new(
        (0..threads)
            .map(|_| (AtomicU64::new(0), AtomicU64::new(u64::MAX)))
            .collect(),
    );
    let (tx, rx) = mpsc::channel();
    for t in 0..threads {
        let mine: Vec<u64> = seeds.iter().copied().skip(t).step_by(threads).collect();
        let (tx, running) = (tx.clone(), Arc::clone(&running));
        std::thread::spawn(move || {
            for seed in mine {
                running[t].0.store(seed, Ordering::Release);
                running[t]
                    .1
                    .store(started.elapsed().as_millis() as u64, Ordering::Release);
                let r = f(seed);
                running[t].1.store(u64::MAX, Ordering::Release);
                if tx.send(r).is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);
    let mut out = Vec::with_capacity(seeds.len());
    while out.len() < seeds.len() {
        match rx.recv_timeout(std::time::Duration::from_millis(500)) {
            Ok(r) => out.push(r),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                out.push(Err("a simulation thread panicked".to_string()));
                break;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = started.elapsed().as_millis() as u64;
                let hung = running.iter().find_map(|(seed, since)| {
                    let since = since.load(Ordering::Acquire);
                    (since != u64::MAX && now.saturating_sub(since) > SEED_WALL.as_millis() as u64)
                        .then(|| seed.load(Ordering::Acquire))
                });
                if let Some(seed) = hung {
                    out.push(Err(format!(
                        "simulation seed {seed} ran for more than {SEED_WALL:?} without ending (hung)\nreplay it alone: KVFERRY_SIM_SEED={seed} cargo test -p kvferry-store --lib sim::"
                    )));
                    break;
                }
            }
        }
    }
    out
}

/// Every seed holds every invariant (see the module docs), and the runs did what they are
/// meant to exercise: failovers, early answers, late writes, expiries, snapshots (leaders
/// dying mid-snapshot, etcd's journal over half its bound), leaders streaming to in-sync
/// standbys, members leaving the set, takeovers from a standby's mirror. A seed that stops
/// making progress fails with its number ([`WORK`], [`SEED_WALL`]).
#[test]
fn every_seed_holds_the_invariants() {
    let seeds = seeds();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(seeds.len().max(1));
    let started = std::time::Instant::now();
    let results = run_seeds(&seeds, |seed| {
        run(seed).map(|(c, _)| c).map_err(|f| report(&f))
    });
    let mut total = Counts::default();
    let mut failures = Vec::new();
    for r in results {
        match r {
            Ok(c) => total += c,
            Err(f) => failures.push(f),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "simulation: {} seeds in {secs:.1} s ({:.0} seeds/s on {threads} threads): {total:?}",
        seeds.len(),
        seeds.len() as f64 / secs
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    if seeds.len() >= 1000 {
        assert!(
            total.tail_rebases > 0
                && total.whole_rebases > 0
                && total.tail_takeovers > 0
                && total.joined_tail_takeovers > 0
                && total.refreshes > 0
                && total.refreshes_given_up > 0
                && total.interleaved_snapshots > 0,
            "the runs did not exercise the kept tails: {total:?}"
        );
    }
    if seeds.len() >= 100 {
        assert!(
            total.failovers > 0
                && total.early_answers > 0
                && total.late_writes > 0
                && total.expiries > 0
                && total.snapshots > 0
                && total.unmounts > 0,
            "the runs did not exercise what they claim: {total:?}"
        );
        assert!(
            total.streamed_terms > 0
                && total.members_dropped > 0
                && total.standby_takeovers > 0
                && total.members_joined > 0
                && total.link_failures > 0
                && total.link_breaks > 0
                && total.hand_offs > 0,
            "the runs did not exercise the in-sync standbys: {total:?}"
        );
        assert!(
            total.snapshots_cut > 0
                && total.etcd_peak_pct > 50
                && total.etcd_errors > 0
                && total.etcd_lost_answers > 0
                && total.writer_give_ups > 0,
            "the runs did not exercise the etcd journal's snapshots: {total:?}"
        );
        assert!(
            total.removals_checked > 0,
            "no acknowledged removal was checked after a failover: {total:?}"
        );
        assert!(
            total.puts_acked > 10 * seeds.len() as u64 && total.reads_checked > seeds.len() as u64,
            "too few puts or reads checked: {total:?}"
        );
    }
}

/// A seed gives the same run every time (what makes `KVFERRY_SIM_SEED` a replay), event for
/// event, also while other tests run beside it.
#[test]
fn a_seed_replays_exactly() {
    for seed in [1, 17, 4242] {
        let (a, end_a) = run_traced(seed);
        let (b, end_b) = run_traced(seed);
        if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
            panic!("seed {seed} ran differently twice from event {i}:\n  {:?}\n  {:?}\nbefore it:\n  {}", a.get(i), b.get(i), a[i.saturating_sub(8)..i].join("\n  "));
        }
        assert_eq!(end_a, end_b, "seed {seed}");
        assert!(a.len() > 100, "seed {seed} did little: {} events", a.len());
    }
}

/// Never two masters admitting at once, nor one whose lease expired, whatever the seed: pauses
/// past the lease, crashes, masters cut off from etcd, lost and late answers, etcd losing its
/// data, takeovers longer than the lease TTL (which, undisturbed, lead with every acknowledged
/// object; see `election/takeover.rs`). (A quarter as many
/// seeds as the state's simulation: each simulates about a minute, millisecond by
/// millisecond.)
#[test]
fn no_two_masters_ever_admit_at_once() {
    let mut seeds = seeds();
    if seeds.len() > 1 {
        seeds.truncate(seeds.len() / 4);
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(seeds.len().max(1));
    let started = std::time::Instant::now();
    let runs = run_seeds(&seeds, super::election::run);
    let mut total = [0u64; 5];
    for r in runs {
        let counts = r.unwrap_or_else(|e| panic!("{e}"));
        for (t, c) in total.iter_mut().zip(counts) {
            *t += c;
        }
    }
    let [leaderships, from_mirror, empty, long, lapsed] = total;
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "election: {} seeds in {secs:.1} s ({:.0} seeds/s on {threads} threads), {leaderships} leaderships, {from_mirror} takeovers from a mirror, {empty} starting empty, {long} leading after a load longer than the lease TTL, {lapsed} failed with their lease run out",
        seeds.len(),
        seeds.len() as f64 / secs
    );
    if seeds.len() >= 100 {
        assert!(
            leaderships > 2 * seeds.len() as u64 && from_mirror > 0 && empty > 0,
            "too few failovers of each kind to mean anything: {leaderships}, {from_mirror} from a mirror, {empty} starting empty"
        );
        assert!(
            long > 0 && lapsed > 0,
            "the runs did not exercise takeovers longer than the lease TTL ({long} led) nor leases run out during one ({lapsed})"
        );
    }
}
