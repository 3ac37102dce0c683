//! Pacing `TerminateInstances` to the bucket EC2 keeps for it.
//!
//! Besides the request rate, EC2 limits the instances terminated per account and region with a
//! resource token bucket: 1,000 instances, refilled at 20 a second ("Request throttling for the
//! Amazon EC2 API", resource rate limiting). A call for more instances than the bucket holds is
//! refused as a whole with `RequestLimitExceeded`. Sending fixed batches of 500 into a bucket that
//! refills at 20 a second therefore meets refusal after refusal, and the SDK's exponential
//! backoff then leaves the bucket full and idle for up to 20 s between attempts: at 5,000
//! instances the terminations took twice EC2's floor. The pacer keeps a model of the bucket and
//! sends only what it holds.
//!
//! The model is an estimate: the account's bucket is shared with everything else that terminates
//! instances there (Karpenter itself, other tools). A refusal says the real bucket is emptier than
//! modelled, so the model restarts from empty and refills from there.

use std::time::{Duration, Instant};

/// Instances the bucket holds when full (EC2's default).
pub(crate) const TERMINATE_BUCKET: f64 = 1000.0;
/// Instances the bucket regains per second (EC2's default).
pub(crate) const TERMINATE_REFILL_PER_SEC: f64 = 20.0;
/// The smallest call the pacer makes while more instances wait: one second of refill. Waiting for
/// this many keeps `TerminateInstances` at about one request a second, a fifth of the action's own
/// request refill (5 a second), and the last instance waits at most a second longer than the floor.
const SMALLEST_CALL: usize = 20;

/// What to do with the instances waiting to be terminated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pace {
    /// Terminate this many now.
    Now(usize),
    /// The bucket holds too few; ask again after this long.
    After(Duration),
}

/// The tool's model of EC2's `TerminateInstances` resource bucket.
#[derive(Debug, Clone)]
pub(crate) struct TerminatePacer {
    tokens: f64,
    at: Instant,
}

impl TerminatePacer {
    /// A full bucket: nothing is known to have been terminated lately, and a wrong guess costs one
    /// refusal, after which the model starts from empty.
    pub(crate) fn new(now: Instant) -> TerminatePacer {
        TerminatePacer { tokens: TERMINATE_BUCKET, at: now }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * TERMINATE_REFILL_PER_SEC).min(TERMINATE_BUCKET);
        self.at = self.at.max(now);
    }

    /// How many of `waiting` instances to terminate now in one call of at most `largest_call`,
    /// or how long to wait until the bucket holds enough for a call worth making.
    pub(crate) fn next(&mut self, waiting: usize, largest_call: usize, now: Instant) -> Pace {
        self.refill(now);
        let want = waiting.min(largest_call);
        if want == 0 {
            return Pace::Now(0);
        }
        let worth = want.min(SMALLEST_CALL);
        // a fraction of a token never pays for an instance
        let have = self.tokens.floor().max(0.0) as usize;
        if have >= worth {
            Pace::Now(have.min(want))
        } else {
            let missing = worth as f64 - self.tokens;
            Pace::After(Duration::from_secs_f64(missing / TERMINATE_REFILL_PER_SEC))
        }
    }

    /// EC2 accepted a call for `n` instances.
    pub(crate) fn spent(&mut self, n: usize, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens - n as f64).max(0.0);
    }

    /// EC2 refused a call as throttled: someone else spends from the same bucket, so start again
    /// from empty.
    pub(crate) fn refused(&mut self, now: Instant) {
        self.refill(now);
        self.tokens = 0.0;
    }
}

/// The time the pacer's users read and wait on: the wall clock, or a test's own.
pub(crate) trait Clock {
    fn now(&self) -> Instant;
    fn sleep(&self, d: Duration) -> impl Future<Output = ()>;
}

/// The process's clock.
pub(crate) struct WallClock;

impl Clock for WallClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn sleep(&self, d: Duration) -> impl Future<Output = ()> {
        tokio::time::sleep(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_full_bucket_takes_the_largest_call_and_then_what_is_left() {
        let t0 = Instant::now();
        let mut p = TerminatePacer::new(t0);
        assert_eq!(p.next(5000, 500, t0), Pace::Now(500));
        p.spent(500, t0);
        assert_eq!(p.next(4500, 500, t0), Pace::Now(500));
        p.spent(500, t0);
        // empty: the next call waits for one second of refill, not for a batch of 500
        assert_eq!(p.next(4000, 500, t0), Pace::After(SECOND));
        assert_eq!(p.next(4000, 500, t0 + SECOND), Pace::Now(20));
        // after a pause the call is as large as the refill since the last call
        p.spent(20, t0 + SECOND);
        assert_eq!(p.next(3980, 500, t0 + 4 * SECOND), Pace::Now(60));
    }

    #[test]
    fn the_pace_matches_the_refill_so_five_thousand_instances_take_the_floor() {
        // 5,000 instances, all waiting at once: EC2 lets the first 1,000 go at once and the
        // other 4,000 at 20 a second, 200 s; a pacer that follows its own advice finishes within
        // a second of that
        let t0 = Instant::now();
        let mut p = TerminatePacer::new(t0);
        let (mut now, mut waiting, mut calls) = (t0, 5000usize, 0);
        while waiting > 0 {
            match p.next(waiting, 500, now) {
                Pace::Now(n) => {
                    p.spent(n, now);
                    waiting -= n;
                    calls += 1;
                }
                Pace::After(d) => now += d,
            }
        }
        let took = now.duration_since(t0).as_secs_f64();
        assert!((199.0..=201.0).contains(&took), "took {took} s");
        assert!(calls <= 2 + 4000 / 20, "{calls} calls");
    }

    #[test]
    fn fewer_waiting_than_the_smallest_call_go_as_soon_as_the_bucket_holds_them() {
        let t0 = Instant::now();
        let mut p = TerminatePacer::new(t0);
        p.spent(1000, t0);
        assert_eq!(p.next(3, 500, t0), Pace::After(Duration::from_millis(150)));
        assert_eq!(p.next(3, 500, t0 + Duration::from_millis(150)), Pace::Now(3));
        assert_eq!(p.next(0, 500, t0), Pace::Now(0));
    }

    #[test]
    fn a_refusal_empties_the_model() {
        let t0 = Instant::now();
        let mut p = TerminatePacer::new(t0);
        assert_eq!(p.next(300, 500, t0), Pace::Now(300));
        // another client emptied the account's bucket: EC2 refuses what the model allowed
        p.refused(t0);
        assert_eq!(p.next(300, 500, t0), Pace::After(SECOND));
        assert_eq!(p.next(300, 500, t0 + 2 * SECOND), Pace::Now(40));
    }

    #[test]
    fn the_bucket_never_holds_more_than_ec2s() {
        let t0 = Instant::now();
        let mut p = TerminatePacer::new(t0);
        p.spent(100, t0);
        assert_eq!(p.next(5000, 5000, t0 + 3600 * SECOND), Pace::Now(1000));
        // a clock read out of order does not mint tokens
        p.spent(1000, t0 + 3600 * SECOND);
        assert_eq!(p.next(5000, 5000, t0), Pace::After(SECOND));
    }
}
