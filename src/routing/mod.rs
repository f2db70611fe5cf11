//! Grey (canary) releases: which deployment of a downstream — its own (`stable`) or one of its
//! variants — serves a request, the live comparison of each variant with stable, the automatic
//! rollback, and reloading all of that without a restart.
//!
//! The routing table is one immutable value behind a `tokio::sync::watch` channel: a request
//! takes one snapshot (an `Arc`) when the dashboard handler starts, and decides every part from
//! it, so a reload never splits one request across two tables, and a request that started on a
//! variant finishes on it even if a reload removed it (the snapshot keeps the instance alive).
//! A reload builds a new table and swaps it in; a variant whose instance settings did not change
//! keeps its instance (bulkhead, breaker, pool, window), so a reload that only moves a
//! percentage does not drop connections or forget the comparison.
//!
//! A downstream without variants costs nothing: while no downstream has an enabled variant with
//! a rule, [`Routing::capture`] is one relaxed atomic load and every part goes to stable, with
//! no window, no header and no allocation.
//!
//! The percentage is sticky per user: the user id is mixed with a fixed key (splitmix64's
//! finaliser, not std's randomly keyed hasher), so the same user gets the same bucket in every
//! replica and after every restart, and raising a share from 10 % to 50 % keeps the first 10 %
//! where they were. Every downstream uses the same buckets, so one user meets all canaries or
//! none at a given share.

mod rollback;

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use http::{HeaderMap, HeaderName, HeaderValue};
use metrics::{Counter, Gauge};
use serde_json::{Value, json, value::RawValue};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{
    config::{
        RoutingSettings, Settings, Sources, VariantName, VariantSettings,
        routing::{HeaderMatch, Match, STABLE},
    },
    domain::Service,
    downstream::{CallError, Downstream, Downstreams, cache::Source},
    overload::QueueDelay,
    telemetry::Family,
};

pub(crate) const ROLLED_BACK: Family = Family::gauge(
    "tributary_downstream_variant_rolled_back",
    "1 while a variant's percentage traffic is rolled back automatically (its error ratio or p99 exceeded stable's by the configured margin), by downstream and variant; stable is always 0.",
);
pub(crate) const RELOADS: Family = Family::counter(
    "tributary_routing_reloads_total",
    "Routing reloads (SIGHUP, a changed file, the admin endpoint), by result (applied, refused).",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[ROLLED_BACK, RELOADS];

/// The fixed key of the sticky bucket: changing it moves every user to another bucket.
const BUCKET_KEY: u64 = 0x7472_6962_7574_6172; // "tributar"

/// The sticky bucket of a user, 0 to 9 999: a share of `p` hundredths of a percent holds the
/// users whose bucket is below `p`.
pub fn bucket(user_id: i64) -> u32 {
    // splitmix64's finaliser: a fixed bijection that spreads consecutive ids evenly.
    let mut z = (user_id as u64) ^ BUCKET_KEY;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z % 10_000) as u32
}

/// Where a variant's percentage traffic stands.
#[derive(Debug, Clone, PartialEq)]
enum Status {
    Active,
    /// Taken away automatically, with the verdict's numbers.
    RolledBack(String),
    /// Taken away by an operator (`POST /admin/routing/.../pause`).
    Paused,
}

/// One variant's instance: what survives a reload that does not change its settings.
struct Instance {
    client: Downstream,
    /// Whether percentage rules may send traffic here (false while rolled back or paused): the
    /// one thing the hot path reads.
    takes_percent: AtomicBool,
    status: Mutex<Status>,
    rolled_back: Gauge,
}

impl Instance {
    fn lock(&self) -> std::sync::MutexGuard<'_, Status> {
        // A status is a plain value; one written before a panic is still a status.
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn status(&self) -> Status {
        self.lock().clone()
    }

    fn set(&self, status: Status) {
        let mut current = self.lock();
        self.takes_percent
            .store(status == Status::Active, Ordering::Relaxed);
        self.rolled_back
            .set(if matches!(status, Status::RolledBack(_)) {
                1.0
            } else {
                0.0
            });
        *current = status;
    }

    /// Percentage traffic back, and a fresh comparison (the failures that caused a rollback
    /// must not cause another one at once).
    fn resume(&self) {
        if self.status() != Status::Active {
            if let Some(w) = self.client.window() {
                w.clear();
            }
            self.set(Status::Active);
        }
    }
}

/// A variant as the current table has it.
struct Variant {
    name: VariantName,
    settings: VariantSettings,
    instance: Arc<Instance>,
}

/// A rule with its variant and header resolved to indexes.
struct Compiled {
    variant: usize,
    when: When,
}

enum When {
    Header {
        index: usize,
        value: HeaderMatch,
    },
    Users {
        ids: Vec<i64>,
        ranges: Vec<(i64, i64)>,
    },
    /// Buckets `from..to`: a downstream's percentage rules take consecutive stretches of
    /// buckets, so two variants at 10 % each get different users.
    Percent {
        from: u32,
        to: u32,
    },
}

#[derive(Default)]
struct Routes {
    variants: Vec<Variant>,
    rules: Vec<Compiled>,
}

impl Routes {
    /// The variant the first matching rule names, if any.
    fn pick(&self, values: &[Option<HeaderValue>], user_id: i64, bucket: u32) -> Option<usize> {
        self.rules.iter().find_map(|rule| {
            let variant = &self.variants[rule.variant];
            if !variant.settings.enabled {
                return None;
            }
            let hit = match &rule.when {
                When::Header { index, value } => values[*index]
                    .as_ref()
                    .is_some_and(|v| value.is_match(v.as_bytes())),
                When::Users { ids, ranges } => {
                    ids.binary_search(&user_id).is_ok()
                        || ranges.iter().any(|(a, b)| (*a..=*b).contains(&user_id))
                }
                When::Percent { from, to } => {
                    (*from..*to).contains(&bucket)
                        && variant.instance.takes_percent.load(Ordering::Relaxed)
                }
            };
            hit.then_some(rule.variant)
        })
    }

    fn has_percent_rule(&self, variant: usize) -> bool {
        self.rules
            .iter()
            .any(|r| r.variant == variant && matches!(r.when, When::Percent { .. }))
    }
}

/// One routing table: immutable, swapped whole by a reload.
pub struct Table {
    generation: u64,
    services: [Routes; 5],
    /// The distinct headers the rules read, captured once per request.
    headers: Vec<HeaderName>,
    routing: RoutingSettings,
}

impl Table {
    fn empty(routing: RoutingSettings) -> Self {
        Self {
            generation: 0,
            services: Default::default(),
            headers: Vec::new(),
            routing,
        }
    }

    /// Whether any request can be routed to a variant.
    fn active(&self) -> bool {
        self.services
            .iter()
            .any(|r| !r.rules.is_empty() && r.variants.iter().any(|v| v.settings.enabled))
    }

    fn find(&self, service: Service, name: &str) -> Option<&Variant> {
        self.services[service as usize]
            .variants
            .iter()
            .find(|v| v.name.as_str() == name)
    }
}

/// The headers a request's rules read, and the table it will be routed by.
pub struct Captured {
    table: Arc<Table>,
    values: Vec<Option<HeaderValue>>,
}

/// Where one request's parts go.
pub struct Route<'a> {
    stable: &'a Downstreams,
    picked: Option<(Arc<Table>, [Option<usize>; 5])>,
}

impl Route<'_> {
    /// The instance that serves `service` for this request.
    pub fn client(&self, service: Service) -> &Downstream {
        if let Some((table, picks)) = &self.picked
            && let Some(i) = picks[service as usize]
        {
            return &table.services[service as usize].variants[i].instance.client;
        }
        self.stable.get(service)
    }

    /// `service`'s part for `user_id` from the instance that serves it: stable's goes through
    /// the service's cache when it has one; a variant's never does (the cache holds stable's
    /// answers, and a variant under test must be asked).
    pub(crate) async fn fetch_part(
        &self,
        service: Service,
        user_id: i64,
    ) -> Result<(Box<RawValue>, Source), CallError> {
        if let Some((table, picks)) = &self.picked
            && let Some(i) = picks[service as usize]
        {
            let variant = &table.services[service as usize].variants[i].instance.client;
            return variant
                .fetch_user_part(user_id)
                .await
                .map(|body| (body, Source::Downstream));
        }
        self.stable.fetch_part(service, user_id).await
    }

    /// `carts=canary,promotions=v2` for the access log, when any part went to a variant.
    pub fn tag(&self) -> Option<String> {
        let (table, picks) = self.picked.as_ref()?;
        let mut tag = String::new();
        for service in Service::ALL {
            if let Some(i) = picks[service as usize] {
                if !tag.is_empty() {
                    tag.push(',');
                }
                tag.push_str(service.as_str());
                tag.push('=');
                tag.push_str(table.services[service as usize].variants[i].name.as_str());
            }
        }
        (!tag.is_empty()).then_some(tag)
    }
}

/// Why a pause or resume could not be done.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("no downstream is called {0:?}")]
    UnknownDownstream(String),
    #[error("{service} has no variant called {name:?}")]
    UnknownVariant { service: Service, name: String },
}

/// The gateway's routing: the current table, and what builds, reloads and judges it.
pub struct Routing {
    stable: Arc<Downstreams>,
    /// The start-up settings: what a variant shares with stable (breaker, retries, HTTP client,
    /// the request deadline) is taken from them, on every reload too.
    base: Arc<Settings>,
    queue_delay: QueueDelay,
    /// Whether the current table can route anything to a variant: the hot path's one check.
    active: AtomicBool,
    table: watch::Sender<Arc<Table>>,
    generation: AtomicU64,
    /// Serialises reloads and admin changes, which read the table and then replace it. Held
    /// only while a table is built, never across an await.
    apply: Mutex<()>,
    /// Where a reload reads the configuration from (`tributary serve` sets it).
    sources: OnceLock<Sources>,
    /// By result: applied, refused.
    reloads: [Counter; 2],
}

impl Routing {
    /// The routing of `settings`; fails only if a variant's HTTP client cannot be built.
    pub(crate) fn new(
        settings: Arc<Settings>,
        stable: Arc<Downstreams>,
        queue_delay: QueueDelay,
    ) -> anyhow::Result<Self> {
        let reloads = ["applied", "refused"].map(|result| {
            let c = metrics::counter!(RELOADS.name, "result" => result);
            c.increment(0);
            c
        });
        for service in Service::ALL {
            metrics::gauge!(ROLLED_BACK.name, "downstream" => service.as_str(), "variant" => STABLE)
                .set(0.0);
        }
        let (table, _) = watch::channel(Arc::new(Table::empty(settings.routing.clone())));
        let routing = Self {
            stable,
            base: Arc::clone(&settings),
            queue_delay,
            active: AtomicBool::new(false),
            table,
            generation: AtomicU64::new(0),
            apply: Mutex::new(()),
            sources: OnceLock::new(),
            reloads,
        };
        routing.apply(&settings)?;
        Ok(routing)
    }

    /// The current table.
    fn snapshot(&self) -> Arc<Table> {
        Arc::clone(&self.table.borrow())
    }

    /// The part of the request the rules read, with the table to route it by; `None` (and
    /// nothing read) while no variant can receive traffic.
    pub fn capture(&self, headers: &HeaderMap) -> Option<Captured> {
        if !self.active.load(Ordering::Relaxed) {
            return None;
        }
        let table = self.snapshot();
        let values = table
            .headers
            .iter()
            .map(|h| headers.get(h).cloned())
            .collect();
        Some(Captured { table, values })
    }

    /// Where `user_id`'s request goes, part by part.
    pub fn route(&self, captured: Option<Captured>, user_id: i64) -> Route<'_> {
        let picked = captured.map(|Captured { table, values }| {
            let bucket = bucket(user_id);
            let picks =
                Service::ALL.map(|s| table.services[s as usize].pick(&values, user_id, bucket));
            (table, picks)
        });
        Route {
            stable: &self.stable,
            picked: picked.filter(|(_, picks)| picks.iter().any(Option::is_some)),
        }
    }

    /// Replaces the table with one built from `settings` (its downstreams' variants and rules
    /// and its `[routing]` section). Every variant's percentage traffic resumes: a reload is
    /// one of the two ways to undo a rollback.
    fn apply(&self, settings: &Settings) -> anyhow::Result<u64> {
        let _applying = self.apply.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.snapshot();
        let window = settings.routing.rollback.window;
        let mut headers: Vec<HeaderName> = Vec::new();
        let mut services: [Routes; 5] = Default::default();
        for service in Service::ALL {
            let own = settings.downstreams.get(service);
            let routes = &mut services[service as usize];
            for (name, variant) in &own.variants {
                let instance = match old.find(service, name.as_str()) {
                    Some(kept) if kept.settings.same_instance(variant) => {
                        Arc::clone(&kept.instance)
                    }
                    _ => Arc::new(Instance {
                        client: Downstream::variant(
                            service,
                            name.as_str(),
                            variant,
                            &self.base,
                            self.queue_delay.clone(),
                            window,
                        )?,
                        takes_percent: AtomicBool::new(true),
                        status: Mutex::new(Status::Active),
                        rolled_back: metrics::gauge!(
                            ROLLED_BACK.name,
                            "downstream" => service.as_str(),
                            "variant" => name.to_string()
                        ),
                    }),
                };
                routes.variants.push(Variant {
                    name: name.clone(),
                    settings: variant.clone(),
                    instance,
                });
            }
            if !own.variants.is_empty() {
                self.stable.get(service).compare_over(window);
            }
            let mut next_bucket = 0;
            for rule in &own.rules {
                // Validation guarantees the variant exists; a rule that names none is dropped.
                let Some(variant) = routes.variants.iter().position(|v| v.name == rule.variant)
                else {
                    continue;
                };
                let when = match &rule.when {
                    Match::Header { name, value } => {
                        let index = headers.iter().position(|h| h == name).unwrap_or_else(|| {
                            headers.push(name.clone());
                            headers.len() - 1
                        });
                        When::Header {
                            index,
                            value: value.clone(),
                        }
                    }
                    Match::Users { ids, ranges } => When::Users {
                        ids: ids.clone(),
                        ranges: ranges.clone(),
                    },
                    Match::Percent(p) => {
                        let from = next_bucket;
                        next_bucket = (from + p.basis_points()).min(10_000);
                        When::Percent {
                            from,
                            to: next_bucket,
                        }
                    }
                };
                routes.rules.push(Compiled { variant, when });
            }
        }
        // Every instance of the new table takes percentage traffic again; one that left the
        // configuration is no longer rolled back either (its alert resolves).
        for routes in &services {
            for v in &routes.variants {
                v.instance.resume();
            }
        }
        for (service, routes) in Service::ALL.into_iter().zip(&old.services) {
            for v in &routes.variants {
                if !services[service as usize]
                    .variants
                    .iter()
                    .any(|n| Arc::ptr_eq(&n.instance, &v.instance))
                {
                    v.instance.rolled_back.set(0.0);
                }
            }
        }
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let table = Table {
            generation,
            services,
            headers,
            routing: settings.routing.clone(),
        };
        self.active.store(table.active(), Ordering::Relaxed);
        self.table.send_replace(Arc::new(table));
        Ok(generation)
    }

    /// Where [`Routing::reload`] reads the configuration from; set once, by `tributary serve`
    /// (SIGHUP) or a test.
    pub fn reload_from(&self, sources: Sources) {
        let _ = self.sources.set(sources);
    }

    /// Loads the configuration again and applies its routing part. A configuration that does
    /// not load or validate is refused with one WARN line, and the running table stays.
    /// Everything else in the file (listeners, pools, stable's own settings) needs a restart.
    pub async fn reload(&self, trigger: &'static str) -> Result<u64, String> {
        let Some(sources) = self.sources.get().cloned() else {
            return Err("no configuration file to reload from".into());
        };
        // Reading and parsing the file is blocking I/O: not on a worker thread.
        let loaded = tokio::task::spawn_blocking(move || Settings::load(&sources))
            .await
            .map_err(|e| format!("the configuration could not be loaded: {e}"))
            .and_then(|r| r.map_err(|e| e.to_string()));
        let applied = loaded.and_then(|settings| {
            let unreloaded = unreloaded_changes(&self.base, &settings);
            self.apply(&settings)
                .map(|generation| (generation, unreloaded))
                .map_err(|e| format!("the new routing could not be built: {e:#}"))
        });
        match applied {
            Ok((generation, unreloaded)) => {
                self.reloads[0].increment(1);
                tracing::info!(trigger, generation, "routing reloaded");
                if !unreloaded.is_empty() {
                    tracing::warn!(
                        sections = %unreloaded.join(", "),
                        "the configuration also changed outside the routing; those changes need a restart"
                    );
                }
                Ok(generation)
            }
            Err(reason) => {
                self.reloads[1].increment(1);
                tracing::warn!(trigger, %reason, "configuration reload refused; the running routing stays");
                Err(reason)
            }
        }
    }

    fn variant_instance(
        &self,
        downstream: &str,
        variant: &str,
    ) -> Result<(Service, Arc<Instance>), AdminError> {
        let service: Service = downstream
            .parse()
            .map_err(|_| AdminError::UnknownDownstream(downstream.to_owned()))?;
        let table = self.snapshot();
        let found = table
            .find(service, variant)
            .ok_or_else(|| AdminError::UnknownVariant {
                service,
                name: variant.to_owned(),
            })?;
        Ok((service, Arc::clone(&found.instance)))
    }

    /// Takes a variant's percentage traffic away until it is resumed (header and user rules
    /// still reach it, so it can be looked at).
    pub fn pause(&self, downstream: &str, variant: &str) -> Result<(), AdminError> {
        let (service, instance) = self.variant_instance(downstream, variant)?;
        instance.set(Status::Paused);
        tracing::info!(downstream = %service, variant, "variant paused by an operator");
        Ok(())
    }

    /// Gives a paused or rolled-back variant its percentage traffic back.
    pub fn resume(&self, downstream: &str, variant: &str) -> Result<(), AdminError> {
        let (service, instance) = self.variant_instance(downstream, variant)?;
        instance.resume();
        tracing::info!(downstream = %service, variant, "variant resumed by an operator");
        Ok(())
    }

    /// The table and the live comparison, for `GET /admin/routing`.
    pub fn describe(&self) -> Value {
        let table = self.snapshot();
        let mut downstreams = BTreeMap::new();
        for service in Service::ALL {
            let routes = &table.services[service as usize];
            if routes.variants.is_empty() {
                continue;
            }
            let stable = self.stable.get(service);
            let variants: Vec<Value> = routes
                .variants
                .iter()
                .map(|v| {
                    let (status, reason) = match v.instance.status() {
                        Status::Active => ("active", None),
                        Status::RolledBack(reason) => ("rolled_back", Some(reason)),
                        Status::Paused => ("paused", None),
                    };
                    json!({
                        "name": v.name.as_str(),
                        "base_url": v.settings.base_url.to_string(),
                        "enabled": v.settings.enabled,
                        "status": status,
                        "reason": reason,
                        "in_flight": v.instance.client.in_flight(),
                        "window": v.instance.client.window().map(|w| w.stats()),
                    })
                })
                .collect();
            let rules: Vec<Value> = self.base_rules(&table, service);
            downstreams.insert(
                service.as_str(),
                json!({
                    "stable": {
                        "in_flight": stable.in_flight(),
                        "window": stable.window().map(|w| w.stats()),
                    },
                    "variants": variants,
                    "rules": rules,
                }),
            );
        }
        json!({
            "generation": table.generation,
            "active": table.active(),
            "rollback": table.routing.rollback,
            "downstreams": downstreams,
        })
    }

    fn base_rules(&self, table: &Table, service: Service) -> Vec<Value> {
        let routes = &table.services[service as usize];
        routes
            .rules
            .iter()
            .map(|r| {
                let variant = routes.variants[r.variant].name.as_str();
                match &r.when {
                    When::Header { index, value } => {
                        let (kind, v) = match value {
                            HeaderMatch::Equals(v) => ("equals", v.clone()),
                            HeaderMatch::Regex(re) => ("matches", re.as_str().to_owned()),
                        };
                        json!({"variant": variant, "header": table.headers[*index].as_str(), kind: v})
                    }
                    When::Users { ids, ranges } => {
                        json!({"variant": variant, "user_ids": ids, "user_ranges": ranges})
                    }
                    When::Percent { from, to } => json!({
                        "variant": variant,
                        "percent": f64::from(to - from) / 100.0,
                        "buckets": [from, to],
                    }),
                }
            })
            .collect()
    }

    /// Starts the rollback judge, and, when a configuration file is known, the reload on
    /// SIGHUP and (with `routing.watch_config`) on a change of the file. All stop with `stop`.
    pub fn spawn_tasks(self: &Arc<Self>, stop: CancellationToken) {
        tokio::spawn(rollback::judge(Arc::clone(self), stop.clone()));
        let Some(sources) = self.sources.get() else {
            return;
        };
        #[cfg(unix)]
        tokio::spawn(reload_on_sighup(Arc::clone(self), stop.clone()));
        if let (true, Some(file)) = (self.base.routing.watch_config, sources.file.clone()) {
            tokio::spawn(reload_on_change(
                Arc::clone(self),
                file,
                self.base.routing.watch_interval,
                stop,
            ));
        }
    }
}

/// The sections of `new` that differ from the running `base` outside what a reload applies
/// (`downstreams.carts`, `server`, ...): they take effect only after a restart. Compared as
/// printed, so a changed secret (printed as `***`) is not noticed.
fn unreloaded_changes(base: &Settings, new: &Settings) -> Vec<String> {
    let strip = |s: &Settings| {
        let mut s = s.clone();
        s.routing = RoutingSettings::default();
        for service in Service::ALL {
            let d = s.downstreams.get_mut(service);
            d.variants.clear();
            d.rules.clear();
        }
        serde_json::to_value(&s).unwrap_or_default()
    };
    let (base, new) = (strip(base), strip(new));
    let mut changed = Vec::new();
    if let (Value::Object(base), Value::Object(new)) = (&base, &new) {
        for (section, value) in new {
            match (section.as_str(), base.get(section), value) {
                ("downstreams", Some(Value::Object(old)), Value::Object(now)) => {
                    for (service, v) in now {
                        if old.get(service) != Some(v) {
                            changed.push(format!("downstreams.{service}"));
                        }
                    }
                }
                (_, old, _) if old != Some(value) => changed.push(section.clone()),
                _ => {}
            }
        }
    }
    changed
}

#[cfg(unix)]
async fn reload_on_sighup(routing: Arc<Routing>, stop: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; reload through the admin endpoint");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            got = hangup.recv() => {
                if got.is_none() {
                    return;
                }
                let _ = routing.reload("sighup").await;
            }
        }
    }
}

/// Polls the file's modification time and length (a ConfigMap update swaps a symlink, which
/// `metadata` follows); a change reloads.
async fn reload_on_change(
    routing: Arc<Routing>,
    file: std::path::PathBuf,
    every: Duration,
    stop: CancellationToken,
) {
    let stamp = |m: std::fs::Metadata| (m.modified().ok(), m.len());
    let mut last = tokio::fs::metadata(&file).await.ok().map(stamp);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let now = tokio::fs::metadata(&file).await.ok().map(stamp);
        if now.is_some() && now != last {
            last = now;
            let _ = routing.reload("file_changed").await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_names_the_changes_it_does_not_apply() {
        let base = Settings::default();
        let mut new = base.clone();
        new.routing.rollback.min_calls = 7;
        new.downstreams.carts.rules = Vec::new();
        assert!(unreloaded_changes(&base, &new).is_empty(), "routing only");
        new.server.request_deadline = Duration::from_secs(3);
        new.downstreams.carts.timeout = Duration::from_secs(3);
        assert_eq!(
            unreloaded_changes(&base, &new),
            ["downstreams.carts", "server"]
        );
    }

    #[test]
    fn buckets_are_fixed_and_spread_evenly() {
        // Pinned: a changed hash would move users between variants on upgrade.
        assert_eq!([bucket(1), bucket(2), bucket(42)], [5852, 3808, 5305]);
        let n = 100_000;
        for share in [1_000u32, 5_000] {
            let inside = (1..=n).filter(|u| bucket(*u) < share).count() as f64 / n as f64;
            let want = f64::from(share) / 10_000.0;
            assert!((inside - want).abs() < 0.01, "{share}: {inside}");
        }
        // Monotone in the share: everyone under 10 % is also under 50 %.
        assert!(
            (1..=n)
                .filter(|u| bucket(*u) < 1_000)
                .all(|u| bucket(u) < 5_000)
        );
    }
}
