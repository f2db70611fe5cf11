//! The automatic rollback: every `routing.rollback.interval`, each variant that takes
//! percentage traffic is compared with stable over the window; one that is worse by more than
//! the margin loses its percentage traffic (header and user rules keep reaching it, so it can
//! still be looked at), with one WARN line that carries the numbers, and
//! `tributary_downstream_variant_rolled_back` at 1 for the alert. It stays so until a reload or
//! `POST /admin/routing/{downstream}/{variant}/resume`: a canary that recovers on its own
//! while it gets no traffic has proven nothing.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::{Routing, Status};
use crate::{config::routing::RollbackSettings, domain::Service, downstream::window::Stats};

/// Why `canary` should lose its percentage traffic, if it should.
pub(super) fn verdict(canary: &Stats, stable: &Stats, s: &RollbackSettings) -> Option<String> {
    if canary.calls < u64::from(s.min_calls) {
        return None;
    }
    let margin = s.error_ratio_margin.get();
    if canary.error_ratio > stable.error_ratio + margin {
        return Some(format!(
            "error ratio {:.1} % over {} calls against stable's {:.1} % over {} calls, more than {:.1} points above",
            canary.error_ratio * 100.0,
            canary.calls,
            stable.error_ratio * 100.0,
            stable.calls,
            margin * 100.0
        ));
    }
    let p99_margin = s.p99_margin.as_secs_f64() * 1000.0;
    // Stable's p99 needs as many calls as the canary's to be a baseline.
    if stable.calls >= u64::from(s.min_calls) && canary.p99_ms > stable.p99_ms + p99_margin {
        return Some(format!(
            "p99 {:.0} ms over {} calls against stable's {:.0} ms over {} calls, more than {:.0} ms above",
            canary.p99_ms, canary.calls, stable.p99_ms, stable.calls, p99_margin
        ));
    }
    None
}

/// Judges the variants until `stop`.
pub(super) async fn judge(routing: Arc<Routing>, stop: CancellationToken) {
    loop {
        let every = routing.snapshot().routing.rollback.interval;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if routing.active.load(std::sync::atomic::Ordering::Relaxed) {
            judge_once(&routing);
        }
    }
}

fn judge_once(routing: &Routing) {
    let table = routing.snapshot();
    let settings = &table.routing.rollback;
    if !settings.enabled {
        return;
    }
    for service in Service::ALL {
        let routes = &table.services[service as usize];
        let Some(stable) = routing.stable.get(service).window().map(|w| w.stats()) else {
            continue;
        };
        for (i, variant) in routes.variants.iter().enumerate() {
            let instance = &variant.instance;
            if !variant.settings.enabled
                || !routes.has_percent_rule(i)
                || instance.status() != Status::Active
            {
                continue;
            }
            let Some(canary) = instance.client.window().map(|w| w.stats()) else {
                continue;
            };
            if let Some(reason) = verdict(&canary, &stable, settings) {
                tracing::warn!(
                    downstream = %service,
                    variant = variant.name.as_str(),
                    variant_calls = canary.calls,
                    variant_error_ratio = canary.error_ratio,
                    variant_p99_ms = canary.p99_ms,
                    stable_calls = stable.calls,
                    stable_error_ratio = stable.error_ratio,
                    stable_p99_ms = stable.p99_ms,
                    window = ?settings.window,
                    "variant rolled back: its percentage traffic goes to stable until resumed: {reason}"
                );
                instance.set(Status::RolledBack(reason));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::Ratio;

    fn stats(calls: u64, failures: u64, p99_ms: f64) -> Stats {
        Stats {
            calls,
            failures,
            error_ratio: failures as f64 / calls.max(1) as f64,
            p99_ms,
        }
    }

    fn settings() -> RollbackSettings {
        RollbackSettings {
            min_calls: 50,
            error_ratio_margin: Ratio::of(0.05),
            p99_margin: Duration::from_millis(100),
            ..RollbackSettings::default()
        }
    }

    #[test]
    fn a_worse_error_ratio_rolls_back_once_there_are_enough_calls() {
        let stable = stats(1000, 10, 20.0);
        assert_eq!(verdict(&stats(49, 49, 20.0), &stable, &settings()), None);
        let why = verdict(&stats(100, 20, 20.0), &stable, &settings()).unwrap();
        assert!(
            why.contains("error ratio 20.0 %") && why.contains("stable's 1.0 %"),
            "{why}"
        );
        assert_eq!(
            verdict(&stats(100, 5, 20.0), &stable, &settings()),
            None,
            "5 % against 1 % is within the 5-point margin"
        );
    }

    #[test]
    fn a_slower_p99_rolls_back_only_against_a_stable_baseline() {
        let why = verdict(&stats(100, 0, 300.0), &stats(100, 0, 50.0), &settings()).unwrap();
        assert!(why.contains("p99 300 ms"), "{why}");
        assert_eq!(
            verdict(&stats(100, 0, 140.0), &stats(100, 0, 50.0), &settings()),
            None
        );
        assert_eq!(
            verdict(&stats(100, 0, 300.0), &stats(10, 0, 50.0), &settings()),
            None,
            "ten stable calls are no baseline"
        );
    }
}
