//! What a simulation run did: its figures, added over the runs.

/// What one run did (reported, and a check that the runs exercise what they claim).
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub puts_acked: u64,
    pub early_answers: u64,
    pub failovers: u64,
    pub late_writes: u64,
    pub reads_checked: u64,
    pub unmounts: u64,
    pub expiries: u64,
    pub snapshots: u64,
    pub streamed_terms: u64,
    pub members_dropped: u64,
    pub standby_takeovers: u64,
    pub relinks: u64,
    pub members_joined: u64,
    /// Links to a standby that failed to connect, and that broke.
    pub link_failures: u64,
    pub link_breaks: u64,
    /// Leaders stopped (SIGTERM) that handed off.
    pub hand_offs: u64,
    /// etcd transactions answered with an error (retried), of them applied all the same
    /// (the answer lost), and writers that gave up (their leader fenced).
    pub etcd_errors: u64,
    pub etcd_lost_answers: u64,
    pub writer_give_ups: u64,
    /// Leaders that died between a snapshot's chunks.
    pub snapshots_cut: u64,
    /// The most etcd held under the journal's prefix, in percent of the bound of
    /// [`super::etcd::bound`] (the largest over the runs added).
    pub etcd_peak_pct: u64,
    /// The most events one run took ([`super::WORK`], the largest over the runs added).
    pub work_peak: u64,
    /// Rebases (the in-sync set emptied, or a stop) that wrote the leader's kept tail, and
    /// that wrote the whole state; standbys' takeovers that wrote the entries they kept.
    pub tail_rebases: u64,
    pub whole_rebases: u64,
    pub tail_takeovers: u64,
    /// Of those, takeovers by a standby that linked while others were in sync, and wrote the
    /// run it was sent with its image (`ToStandby::Run`).
    pub joined_tail_takeovers: u64,
    /// Background snapshots while standbys were in sync (`refresh_base`): written, given up.
    pub refreshes: u64,
    pub refreshes_given_up: u64,
    /// Acknowledged removals checked against a new leader.
    pub removals_checked: u64,
    /// Snapshots whose chunks were written between the writer's commits (entries appended
    /// after the snapshot's position, kept by its head).
    pub interleaved_snapshots: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        self.puts_acked += o.puts_acked;
        self.early_answers += o.early_answers;
        self.failovers += o.failovers;
        self.late_writes += o.late_writes;
        self.reads_checked += o.reads_checked;
        self.unmounts += o.unmounts;
        self.expiries += o.expiries;
        self.snapshots += o.snapshots;
        self.streamed_terms += o.streamed_terms;
        self.members_dropped += o.members_dropped;
        self.standby_takeovers += o.standby_takeovers;
        self.relinks += o.relinks;
        self.members_joined += o.members_joined;
        self.link_failures += o.link_failures;
        self.link_breaks += o.link_breaks;
        self.hand_offs += o.hand_offs;
        self.etcd_errors += o.etcd_errors;
        self.etcd_lost_answers += o.etcd_lost_answers;
        self.writer_give_ups += o.writer_give_ups;
        self.snapshots_cut += o.snapshots_cut;
        self.etcd_peak_pct = self.etcd_peak_pct.max(o.etcd_peak_pct);
        self.work_peak = self.work_peak.max(o.work_peak);
        self.tail_rebases += o.tail_rebases;
        self.whole_rebases += o.whole_rebases;
        self.tail_takeovers += o.tail_takeovers;
        self.joined_tail_takeovers += o.joined_tail_takeovers;
        self.refreshes += o.refreshes;
        self.refreshes_given_up += o.refreshes_given_up;
        self.removals_checked += o.removals_checked;
        self.interleaved_snapshots += o.interleaved_snapshots;
    }
}
