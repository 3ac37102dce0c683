//! What a run produced, folded from its events: the engine's tasks report what they found
//! (blockers, pods re-bound to fenced nodes, verification's leftovers and what `--reclaim`
//! removed) as [`EngineEvent`]s, and the run's result is this fold over them, as the live view is
//! another. No task writes a result into shared state.

use std::collections::BTreeSet;

use super::events::EngineEvent;
use crate::report::{Blocker, Bypass};
use crate::verify::Leftovers;

/// The results of a run so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RunRecord {
    /// What blocked or fought the run, each once, in the order first seen.
    pub(crate) blockers: Vec<Blocker>,
    /// UIDs of the pods bound to a node after its drain began.
    pub(crate) rebound: BTreeSet<String>,
    /// UIDs of the pods that went down with their node.
    pub(crate) lost: BTreeSet<String>,
    /// What the last verification found.
    pub(crate) leftovers: Leftovers,
    /// What `--reclaim` removed.
    pub(crate) reclaimed: Vec<String>,
    /// The pods let go without an eviction, each once.
    pub(crate) bypasses: BTreeSet<Bypass>,
}

impl RunRecord {
    /// Takes one event in; returns whether it tells the readers downstream anything new (a
    /// blocker seen before is not passed on twice).
    pub(crate) fn apply(&mut self, ev: &EngineEvent) -> bool {
        match ev {
            EngineEvent::Blocker(b) => {
                if self.blockers.contains(b) {
                    return false;
                }
                self.blockers.push(b.clone());
            }
            EngineEvent::Bypassed(b) => {
                if !self.bypasses.insert(b.clone()) {
                    return false;
                }
            }
            EngineEvent::PodsRebound { uids, .. } => {
                self.rebound.extend(uids.iter().cloned());
            }
            EngineEvent::PodsLost { uids, .. } => {
                self.lost.extend(uids.iter().cloned());
            }
            EngineEvent::Verified { leftovers, reclaimed } => {
                self.leftovers = leftovers.clone();
                self.reclaimed.extend(reclaimed.iter().cloned());
            }
            EngineEvent::RunStarted { .. }
            | EngineEvent::MachineFoundLate { .. }
            | EngineEvent::TaskStarted(_)
            | EngineEvent::DrainProgress { .. }
            | EngineEvent::DrainDeadlinePassed { .. }
            | EngineEvent::TaskEnded { .. } => {}
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::BlockerKind;

    fn blocker(name: &str) -> EngineEvent {
        EngineEvent::Blocker(Blocker { kind: BlockerKind::Pdb, name: name.into(), reason: "allows 0".into() })
    }

    #[test]
    fn a_blocker_counts_once_and_is_passed_on_once() {
        let mut r = RunRecord::default();
        assert!(r.apply(&blocker("shop/web")));
        assert!(!r.apply(&blocker("shop/web")), "a repeat tells nobody anything new");
        assert!(r.apply(&blocker("shop/db")));
        let names: Vec<&str> = r.blockers.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["shop/web", "shop/db"]);
    }

    #[test]
    fn a_pod_lost_with_its_node_counts_once() {
        let mut r = RunRecord::default();
        let lost = |uids: &[&str]| EngineEvent::PodsLost {
            node: "n1".into(),
            uids: uids.iter().map(|u| u.to_string()).collect(),
        };
        r.apply(&lost(&["a"]));
        r.apply(&lost(&["a", "b"]));
        assert_eq!(r.lost.len(), 2);
        assert!(r.rebound.is_empty(), "lost is not rebound");
    }

    #[test]
    fn a_pod_rebound_twice_counts_once_and_the_last_verification_wins() {
        let mut r = RunRecord::default();
        let rebound = |uids: &[&str]| EngineEvent::PodsRebound {
            node: "n1".into(),
            uids: uids.iter().map(|u| u.to_string()).collect(),
        };
        r.apply(&rebound(&["a", "b"]));
        r.apply(&rebound(&["b", "c"]));
        assert_eq!(r.rebound.len(), 3);
        let first = Leftovers { objects: vec!["NodeClaim/x".into()], ..Leftovers::default() };
        r.apply(&EngineEvent::Verified { leftovers: first, reclaimed: vec!["i-1".into()] });
        r.apply(&EngineEvent::Verified { leftovers: Leftovers::default(), reclaimed: Vec::new() });
        assert_eq!(r.leftovers, Leftovers::default(), "the verification after a reclaim is the one that counts");
        assert_eq!(r.reclaimed, ["i-1"], "what was reclaimed stays reclaimed");
    }
}
