//! The process exit codes: a fixed contract with Terraform, CI and scripts (see the README).

use std::fmt;

/// What a run ended with, in the order of precedence the design fixes (design §7).
///
/// `BadInput` and `Refused` are decided before any change is made; during a run `Interrupted`
/// wins over `Blocked`, which wins over `Leftovers`, which wins over `Failure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Exit {
    /// 0: verification found nothing left.
    Clean,
    /// 1: something failed; the message and report say what.
    Failure,
    /// 2: bad input or configuration (plan, flags, kubeconfig, credentials, endpoints).
    BadInput,
    /// 3: refused by a safety guard (wrong cluster, blast radius); nothing was changed.
    Refused,
    /// 4: the run finished but leftovers remain (listed in the report).
    Leftovers,
    /// 5: blocked past a deadline under policy `fail` (the blockers are named).
    Blocked,
    /// 6: the plan ran to its end without a `verify` step: nothing proves what is left.
    Unverified,
    /// 130: interrupted by Ctrl-C or SIGTERM.
    Interrupted,
}

impl Exit {
    /// The numeric process exit code.
    pub fn code(self) -> u8 {
        match self {
            Exit::Clean => 0,
            Exit::Failure => 1,
            Exit::BadInput => 2,
            Exit::Refused => 3,
            Exit::Leftovers => 4,
            Exit::Blocked => 5,
            Exit::Unverified => 6,
            Exit::Interrupted => 130,
        }
    }

    /// The status a process exit code stands for (any code this tool does not use is a failure).
    #[cfg_attr(
        not(feature = "sandbox"),
        allow(dead_code, reason = "only `rehearse` uses it, and the lean build leaves `rehearse` out")
    )]
    pub(crate) fn from_code(code: u8) -> Exit {
        match code {
            0 => Exit::Clean,
            2 => Exit::BadInput,
            3 => Exit::Refused,
            4 => Exit::Leftovers,
            5 => Exit::Blocked,
            6 => Exit::Unverified,
            130 => Exit::Interrupted,
            _ => Exit::Failure,
        }
    }

    /// Combines two outcomes of one run, keeping the one that takes precedence.
    pub(crate) fn worst(self, other: Exit) -> Exit {
        if other.rank() > self.rank() { other } else { self }
    }

    fn rank(self) -> u8 {
        match self {
            Exit::Clean => 0,
            // only ever in place of clean: any other outcome says more
            Exit::Unverified => 1,
            Exit::Failure => 2,
            Exit::Leftovers => 3,
            Exit::Blocked => 4,
            Exit::Interrupted => 5,
            Exit::Refused => 6,
            Exit::BadInput => 7,
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self {
            Exit::Clean => "clean: nothing left",
            Exit::Failure => "failure",
            Exit::BadInput => "bad input or configuration",
            Exit::Refused => "refused by a safety guard, nothing changed",
            Exit::Leftovers => "finished, but leftovers remain",
            Exit::Blocked => "blocked past a deadline under policy `fail`",
            Exit::Unverified => "finished without a verify step: nothing proves what is left",
            Exit::Interrupted => "interrupted",
        };
        write!(f, "{} ({what})", self.code())
    }
}

/// The exit-code table as shown in `--help` and the README.
pub(crate) const EXIT_CODES_HELP: &str = "\
Exit codes:
  0    clean: verification found nothing left
  1    failure (see the message and the report)
  2    bad input or configuration (plan, flags, kubeconfig, credentials, endpoints, a missing
       permission, a webhook or admission policy that would refuse a write); nothing changed
  3    refused by a safety guard (wrong cluster, too many nodes, a GitOps owner, a load balancer
       or volume controller the drain would strand or that cannot be placed, a Karpenter leader
       no Deployment runs); nothing changed
  4    finished, but leftovers remain (listed in the report; --reclaim removes them)
  5    blocked past a deadline under --on-drain-deadline fail, an instance EC2 never described,
       or a --reclaim under a live node (the blockers are named)
  6    unverified: the plan has no verify step, so nothing proves what is left
  130  interrupted (Ctrl-C or SIGTERM); run again to resume";

/// An error and its causes in one message, each cause said once: what the user reads after
/// `error:` (the AWS SDK's `DisplayErrorContext` would append the whole structure as `Debug`,
/// response headers and all; kube's top error names only the layer that failed).
pub(crate) fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(err) = next {
        let msg = err.to_string();
        if !msg.is_empty() && !parts.iter().any(|p| p.contains(&msg)) {
            parts.push(msg);
        }
        next = err.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_follows_the_design() {
        assert_eq!(Exit::Clean.worst(Exit::Leftovers), Exit::Leftovers);
        assert_eq!(Exit::Failure.worst(Exit::Leftovers), Exit::Leftovers);
        assert_eq!(Exit::Leftovers.worst(Exit::Blocked), Exit::Blocked);
        assert_eq!(Exit::Interrupted.worst(Exit::Blocked), Exit::Interrupted);
        assert_eq!(Exit::Clean.worst(Exit::Clean), Exit::Clean);
        assert_eq!(Exit::Clean.worst(Exit::Unverified), Exit::Unverified);
        assert_eq!(Exit::Unverified.worst(Exit::Failure), Exit::Failure);
    }

    #[test]
    fn codes_are_the_documented_ones() {
        let all = [
            Exit::Clean,
            Exit::Failure,
            Exit::BadInput,
            Exit::Refused,
            Exit::Leftovers,
            Exit::Blocked,
            Exit::Unverified,
            Exit::Interrupted,
        ];
        for e in all {
            let line = format!("  {:<4} ", e.code());
            assert!(EXIT_CODES_HELP.contains(&line), "{e} missing from the help table");
        }
    }
}
