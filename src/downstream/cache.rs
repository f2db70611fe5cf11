//! The optional answer cache in front of one downstream client (`downstreams.<service>.cache`).
//!
//! Why it exists: several dashboard parts are the same for many requests (site-wide
//! promotions) or change slowly for one user, and a burst of dashboards would otherwise make
//! the same call hundreds of times. The design, in `docs/caching.md`, in short:
//!
//! - **Storage** is a moka future cache per service, bounded in bytes by its weigher (body
//!   plus key), each entry living for its freshness plus `stale_if_error` ([`Lifetime`]);
//!   freshness is checked on read, so the same entry serves hits while fresh and stands in for
//!   a failed call while stale.
//! - **Single flight**: a miss joins the one call in flight for its key, or starts it. The
//!   call runs in a task of its own with the gateway's full deadline, not inside the request
//!   that started it, so that request's cancellation (its client left, its own short budget
//!   ran out) never cancels the call the others wait for. Each waiter waits only until its
//!   own deadline. moka's own coalescing (`try_get_with`) is not used for this: it coalesces
//!   only keys that are absent, while a stale entry kept for `stale_if_error` is present, and
//!   its init future belongs to the first caller, whose cancellation makes a waiter start a
//!   second call.
//!   A request with too little budget left to make a call itself starts none (it joins one in
//!   flight, or takes a stale entry, or gives up), so tiny budgets cannot start full-length
//!   calls.
//! - **Errors are never stored**: a failed call answers the requests that waited for it and is
//!   forgotten.
//! - **`Cache-Control`** (with `honour_cache_control`) decides per answer whether it is stored
//!   and for how long ([`Directives`], [`Inner::rule`]); an answer that may not be stored in
//!   a `shared` cache is not handed to other users' waiting requests either.
//!
//! With no `cache` settings a service has no `PartCache` at all, and its calls take the
//! uncached path of [`super::Downstreams::fetch_part`] unchanged.

use std::{
    collections::HashMap,
    mem::size_of,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{
    FutureExt,
    future::{BoxFuture, Shared},
};
use metrics::{Counter, Gauge, Unit};
use moka::{Expiry, notification::RemovalCause};
use serde_json::value::RawValue;
use tokio::time::Instant;
use tracing::Instrument;

use super::{CallError, Downstream, TimeoutCause};
use crate::{
    config::{CacheKey, CacheSettings},
    context::{self, RequestContext},
    domain::Service,
    telemetry::Family,
};

pub(crate) const HITS: Family = Family::counter(
    "tributary_cache_hits_total",
    "Cached downstream parts answered from a fresh entry, per service.",
);
pub(crate) const MISSES: Family = Family::counter(
    "tributary_cache_misses_total",
    "Cache lookups that started a downstream call (no entry, a stale one, or an answer another user's call could not share), per service.",
);
pub(crate) const COALESCED: Family = Family::counter(
    "tributary_cache_coalesced_total",
    "Cache lookups that waited for a downstream call another request had started, per service.",
);
pub(crate) const STALE_SERVED: Family = Family::counter(
    "tributary_cache_stale_served_total",
    "Stale entries served because the fresh call failed or did not answer in time (within stale_if_error), per service.",
);
pub(crate) const EVICTIONS: Family = Family::counter(
    "tributary_cache_evictions_total",
    "Entries removed from a cache, per service and cause (size: over max_bytes; expired: past freshness plus stale_if_error; invalidated: by the admin endpoint).",
);
pub(crate) const WEIGHTED_BYTES: Family = Family::gauge(
    "tributary_cache_weighted_bytes",
    "Bytes held by a cache as its weigher counts them (bodies plus keys), per service; bounded by max_bytes.",
)
.in_unit(Unit::Bytes);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[
    HITS,
    MISSES,
    COALESCED,
    STALE_SERVED,
    EVICTIONS,
    WEIGHTED_BYTES,
];

/// Where a part's body came from; its `Server-Timing` description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The service has no cache: a plain call.
    Downstream,
    /// No fresh entry: this request's call answered it.
    Miss,
    /// A fresh entry.
    Hit,
    /// Another request's call, waited for.
    Coalesced,
    /// A stale entry, because the call failed or was too late.
    Stale,
}

impl Source {
    /// `desc` in `Server-Timing`; none for a service without a cache.
    pub(crate) fn timing_desc(self) -> Option<&'static str> {
        match self {
            Source::Downstream => None,
            Source::Miss => Some("miss"),
            Source::Hit => Some("hit"),
            Source::Coalesced => Some("coalesced"),
            Source::Stale => Some("stale"),
        }
    }
}

/// What an answer's `Cache-Control` says, as far as this cache acts on it. `Copy` and parsed
/// without allocating.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Directives {
    no_store: bool,
    private: bool,
    no_cache: bool,
    max_age: Option<u64>,
    s_maxage: Option<u64>,
}

impl Directives {
    /// Parses a `Cache-Control` value (RFC 9111 §5.2.2). Names are case-insensitive; a
    /// `max-age` that is not a number makes the answer stale at once (§4.2.1); directives this
    /// cache does not act on are ignored.
    pub(crate) fn parse(value: &str) -> Self {
        let mut d = Self::default();
        let seconds = |arg: Option<&str>| {
            Some(
                arg.and_then(|a| a.trim_matches('"').parse().ok())
                    .unwrap_or(0),
            )
        };
        for directive in value.split(',') {
            let (name, arg) = match directive.split_once('=') {
                Some((name, arg)) => (name.trim(), Some(arg.trim())),
                None => (directive.trim(), None),
            };
            if name.eq_ignore_ascii_case("no-store") {
                d.no_store = true;
            } else if name.eq_ignore_ascii_case("private") {
                d.private = true;
            } else if name.eq_ignore_ascii_case("no-cache") {
                d.no_cache = true;
            } else if name.eq_ignore_ascii_case("max-age") {
                d.max_age = seconds(arg);
            } else if name.eq_ignore_ascii_case("s-maxage") {
                d.s_maxage = seconds(arg);
            }
        }
        d
    }
}

/// What to do with one successful answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rule {
    store: bool,
    fresh_for: Duration,
    /// Whether requests of other users that waited for this call may have it.
    shareable: bool,
}

/// Which entry a request's part is kept under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Key {
    User(i64),
    /// The one entry of a `shared` cache.
    Shared,
}

/// One stored answer.
#[derive(Debug)]
struct Cached {
    body: Box<RawValue>,
    fetched_at: Instant,
    fresh_for: Duration,
}

impl Cached {
    fn is_fresh(&self) -> bool {
        self.fetched_at.elapsed() < self.fresh_for
    }

    /// Young enough to stand in for a failed call.
    fn usable_stale(&self, stale_if_error: Duration) -> bool {
        self.fetched_at.elapsed() < self.fresh_for + stale_if_error
    }
}

/// An entry's cost against `max_bytes`: its body, its key and the entry itself (moka's own
/// bookkeeping per entry is not counted).
fn weight(_key: &Key, value: &Cached) -> u32 {
    let bytes = value.body.get().len() + size_of::<Key>() + size_of::<Cached>();
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// An entry lives for its freshness plus `stale_if_error`, from when it was stored.
struct Lifetime {
    stale_if_error: Duration,
}

impl Expiry<Key, Arc<Cached>> for Lifetime {
    fn expire_after_create(
        &self,
        _key: &Key,
        value: &Arc<Cached>,
        _created_at: std::time::Instant,
    ) -> Option<Duration> {
        Some(value.fresh_for + self.stale_if_error)
    }

    fn expire_after_update(
        &self,
        _key: &Key,
        value: &Arc<Cached>,
        _updated_at: std::time::Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.fresh_for + self.stale_if_error)
    }
}

/// What a call in flight answers each request that waited for it.
#[derive(Debug, Clone)]
struct Answer {
    value: Result<Arc<Cached>, CallError>,
    /// The user whose request started the call (its id is in the path).
    for_user: i64,
    shareable: bool,
}

struct Flight {
    id: u64,
    answer: Shared<BoxFuture<'static, Answer>>,
}

/// One service's cache instruments, registered (at 0) for every service at start-up.
pub(crate) struct Instruments {
    hits: Counter,
    misses: Counter,
    coalesced: Counter,
    stale: Counter,
    /// By cause: size, expired, invalidated.
    evictions: [Counter; 3],
    bytes: Gauge,
}

impl Instruments {
    pub(crate) fn register(service: Service) -> Self {
        let service = service.as_str();
        let counter = |family: Family| {
            let c = metrics::counter!(family.name, "downstream" => service);
            c.increment(0);
            c
        };
        let bytes = metrics::gauge!(WEIGHTED_BYTES.name, "downstream" => service);
        bytes.set(0.0);
        Self {
            hits: counter(HITS),
            misses: counter(MISSES),
            coalesced: counter(COALESCED),
            stale: counter(STALE_SERVED),
            evictions: ["size", "expired", "invalidated"].map(|cause| {
                let c =
                    metrics::counter!(EVICTIONS.name, "downstream" => service, "cause" => cause);
                c.increment(0);
                c
            }),
            bytes,
        }
    }
}

/// The cache in front of one service: see the module doc.
pub struct PartCache {
    inner: Arc<Inner>,
}

struct Inner {
    service: Service,
    key: CacheKey,
    ttl: Duration,
    honour_cache_control: bool,
    stale_if_error: Duration,
    /// The deadline a call in flight runs under: the gateway's own, not any one caller's.
    request_deadline: Duration,
    store: moka::future::Cache<Key, Arc<Cached>>,
    /// Calls in flight by key. A std mutex: it is held only to look up, insert or remove,
    /// never across an `.await`.
    flights: Mutex<HashMap<Key, Flight>>,
    next_flight: AtomicU64,
    /// Bumped by every invalidation: a call that started before one does not store its answer.
    epoch: AtomicU64,
    metrics: Instruments,
}

impl PartCache {
    pub(crate) fn new(
        service: Service,
        policy: &CacheSettings,
        request_deadline: Duration,
        metrics: Instruments,
    ) -> Self {
        let (evictions, bytes) = (metrics.evictions.clone(), metrics.bytes.clone());
        let store = moka::future::Cache::builder()
            .name(service.as_str())
            .max_capacity(policy.max_bytes.get())
            .weigher(|key, value: &Arc<Cached>| weight(key, value))
            .expire_after(Lifetime {
                stale_if_error: policy.stale_if_error,
            })
            .eviction_listener(move |key: Arc<Key>, value: Arc<Cached>, cause| {
                bytes.decrement(f64::from(weight(&key, &value)));
                let i = match cause {
                    RemovalCause::Size => 0,
                    RemovalCause::Expired => 1,
                    RemovalCause::Explicit => 2,
                    RemovalCause::Replaced => return,
                };
                evictions[i].increment(1);
            })
            .build();
        Self {
            inner: Arc::new(Inner {
                service,
                key: policy.key,
                ttl: policy.ttl,
                honour_cache_control: policy.honour_cache_control,
                stale_if_error: policy.stale_if_error,
                request_deadline,
                store,
                flights: Mutex::new(HashMap::new()),
                next_flight: AtomicU64::new(0),
                epoch: AtomicU64::new(0),
                metrics,
            }),
        }
    }

    /// The part for `user_id`: a fresh entry, else the call in flight for its key (joined or
    /// started), waited for until the request's deadline; when that call fails or is too late,
    /// an entry stale by less than `stale_if_error`.
    pub(crate) async fn fetch(
        &self,
        client: &Arc<Downstream>,
        user_id: i64,
    ) -> Result<(Box<RawValue>, Source), CallError> {
        let inner = &self.inner;
        let key = inner.key_for(user_id);
        let stored = inner.store.get(&key).await;
        if let Some(entry) = &stored
            && entry.is_fresh()
        {
            inner.metrics.hits.increment(1);
            return Ok((entry.body.clone(), Source::Hit));
        }
        // A request that could not make a call itself starts none that would outlive it: with
        // the cache, a flood of tiny budgets would otherwise each start a full-length call.
        let may_start = context::remaining() >= super::MIN_CALL_BUDGET;
        let Some((answer, led)) = self.join(key, client, user_id, may_start) else {
            let exhausted = CallError::BudgetExhausted {
                service: inner.service,
            };
            return self.stale_or(exhausted, stored);
        };
        let (counter, source) = if led {
            (&inner.metrics.misses, Source::Miss)
        } else {
            (&inner.metrics.coalesced, Source::Coalesced)
        };
        counter.increment(1);
        let result = match tokio::time::timeout_at(context::deadline(), answer).await {
            Ok(Answer {
                value: Ok(entry),
                for_user,
                shareable,
            }) if shareable || for_user == user_id => return Ok((entry.body.clone(), source)),
            // Another user's answer that may not be shared: this request asks for its own,
            // and does not store it.
            Ok(Answer { value: Ok(_), .. }) => {
                inner.metrics.misses.increment(1);
                client.fetch_user_part(user_id).await
            }
            Ok(Answer { value: Err(e), .. }) => Err(e),
            // This request's budget ran out; the call goes on for the others.
            Err(_) => Err(CallError::Timeout {
                service: inner.service,
                cause: TimeoutCause::RequestBudget,
            }),
        };
        match result {
            Ok(body) => Ok((body, Source::Miss)),
            Err(e) => self.stale_or(e, stored),
        }
    }

    /// The stale entry, when it is young enough to stand in for the failed call; else `e`.
    fn stale_or(
        &self,
        e: CallError,
        stored: Option<Arc<Cached>>,
    ) -> Result<(Box<RawValue>, Source), CallError> {
        match stored {
            Some(entry) if entry.usable_stale(self.inner.stale_if_error) => {
                self.inner.metrics.stale.increment(1);
                Ok((entry.body.clone(), Source::Stale))
            }
            _ => Err(e),
        }
    }

    /// The call in flight for `key`, and whether this request started it; `None` when there
    /// is none and `may_start` is false.
    fn join(
        &self,
        key: Key,
        client: &Arc<Downstream>,
        user_id: i64,
        may_start: bool,
    ) -> Option<(Shared<BoxFuture<'static, Answer>>, bool)> {
        let inner = &self.inner;
        let mut flights = inner.flights();
        if let Some(flight) = flights.get(&key) {
            return Some((flight.answer.clone(), false));
        }
        if !may_start {
            return None;
        }
        let id = inner.next_flight.fetch_add(1, Ordering::Relaxed);
        let answer = self.start(key, id, client, user_id);
        flights.insert(
            key,
            Flight {
                id,
                answer: answer.clone(),
            },
        );
        Some((answer, true))
    }

    /// Spawns the call for `key`: it belongs to no request, so no request's cancellation ends
    /// it, and it is bounded by the gateway's own deadline and the service's timeout.
    fn start(
        &self,
        key: Key,
        id: u64,
        client: &Arc<Downstream>,
        user_id: i64,
    ) -> Shared<BoxFuture<'static, Answer>> {
        let inner = Arc::clone(&self.inner);
        let client = Arc::clone(client);
        let service = inner.service;
        let epoch = inner.epoch.load(Ordering::Acquire);
        let deadline = Instant::now() + inner.request_deadline;
        // The caller's request id and trace travel on, so the call is found from the request
        // that started it.
        let ctx = context::current().map(|c| {
            Arc::new(RequestContext::new(
                Arc::clone(&c.request_id),
                c.trace.clone(),
                deadline,
            ))
        });
        let span = tracing::info_span!(parent: None, "cache.fill", downstream = service.as_str());
        span.follows_from(tracing::Span::current());
        let call = async move {
            let _landing = Landing {
                inner: Arc::clone(&inner),
                key,
                id,
            };
            // A call that ended between this request's lookup and this start stored its
            // answer: use it rather than call again.
            if let Some(entry) = inner.store.get(&key).await
                && entry.is_fresh()
            {
                return Answer {
                    value: Ok(entry),
                    for_user: user_id,
                    shareable: true,
                };
            }
            match client.fetch(user_id).await {
                Ok(fetched) => {
                    let rule = inner.rule(fetched.directives);
                    let entry = Arc::new(Cached {
                        body: fetched.body,
                        fetched_at: Instant::now(),
                        fresh_for: rule.fresh_for,
                    });
                    if rule.store && inner.epoch.load(Ordering::Acquire) == epoch {
                        inner
                            .metrics
                            .bytes
                            .increment(f64::from(weight(&key, &entry)));
                        inner.store.insert(key, Arc::clone(&entry)).await;
                        // Invalidated while it was being stored: it must not stay.
                        if inner.epoch.load(Ordering::Acquire) != epoch {
                            inner.store.invalidate(&key).await;
                        }
                    }
                    Answer {
                        value: Ok(entry),
                        for_user: user_id,
                        shareable: rule.shareable,
                    }
                }
                Err(e) => Answer {
                    value: Err(e),
                    for_user: user_id,
                    shareable: false,
                },
            }
        }
        .instrument(span);
        let task = match ctx {
            Some(ctx) => tokio::spawn(context::scope(ctx, call)),
            None => tokio::spawn(call),
        };
        async move {
            task.await.unwrap_or(Answer {
                value: Err(CallError::Abandoned { service }),
                for_user: user_id,
                shareable: false,
            })
        }
        .boxed()
        .shared()
    }

    /// Drops every entry, and forgets the calls in flight (they answer their waiters but
    /// store nothing).
    pub fn invalidate_all(&self) {
        let inner = &self.inner;
        inner.epoch.fetch_add(1, Ordering::AcqRel);
        inner.flights().clear();
        inner.store.invalidate_all();
    }

    /// Drops one entry, and forgets its call in flight.
    pub async fn invalidate(&self, key: Key) {
        let inner = &self.inner;
        inner.epoch.fetch_add(1, Ordering::AcqRel);
        inner.flights().remove(&key);
        inner.store.invalidate(&key).await;
    }

    /// The key an admin path segment names: a user id in a `per_user` cache, `shared` in a
    /// `shared` one.
    pub fn key_from_path(&self, segment: &str) -> Result<Key, &'static str> {
        match self.inner.key {
            CacheKey::PerUser => segment
                .parse::<i64>()
                .ok()
                .filter(|id| *id > 0)
                .map(Key::User)
                .ok_or("must be a user id (a positive integer) in a per_user cache"),
            CacheKey::Shared if segment == "shared" => Ok(Key::Shared),
            CacheKey::Shared => Err("must be \"shared\" in a shared cache"),
        }
    }

    /// Runs moka's pending maintenance (evictions, size accounting) now: for tests.
    pub async fn run_pending_tasks(&self) {
        self.inner.store.run_pending_tasks().await;
    }

    /// The bytes held as the weigher counts them (exact after [`Self::run_pending_tasks`]).
    pub fn weighted_size(&self) -> u64 {
        self.inner.store.weighted_size()
    }

    /// Entries held (exact after [`Self::run_pending_tasks`]).
    pub fn entry_count(&self) -> u64 {
        self.inner.store.entry_count()
    }
}

impl Inner {
    fn key_for(&self, user_id: i64) -> Key {
        match self.key {
            CacheKey::PerUser => Key::User(user_id),
            CacheKey::Shared => Key::Shared,
        }
    }

    /// Whether and for how long an answer is kept, from its directives.
    fn rule(&self, d: Directives) -> Rule {
        if !self.honour_cache_control {
            return Rule {
                store: true,
                fresh_for: self.ttl,
                shareable: true,
            };
        }
        let shared = self.key == CacheKey::Shared;
        // A per-user entry only ever answers its own user, which is what `private` asks for.
        let storable = !(d.no_store || (shared && d.private));
        let max_age = if shared {
            d.s_maxage.or(d.max_age)
        } else {
            d.max_age
        };
        let fresh_for = match (d.no_cache, max_age) {
            // No way to revalidate here: never fresh.
            (true, _) => Duration::ZERO,
            (false, Some(secs)) => self.ttl.min(Duration::from_secs(secs)),
            (false, None) => self.ttl,
        };
        Rule {
            // Never fresh and never to stand in for an error: nothing to keep it for.
            store: storable && !(fresh_for.is_zero() && self.stale_if_error.is_zero()),
            fresh_for,
            shareable: !d.no_store && !d.private,
        }
    }

    /// The flights map; a poisoned lock still holds a valid map (every change is one call).
    fn flights(&self) -> MutexGuard<'_, HashMap<Key, Flight>> {
        self.flights.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Removes its flight when the call ends, however it ends, unless an invalidation already
/// replaced it. Runs after the answer is stored, so a request that finds no flight finds the
/// entry.
struct Landing {
    inner: Arc<Inner>,
    key: Key,
    id: u64,
}

impl Drop for Landing {
    fn drop(&mut self) {
        let mut flights = self.inner.flights();
        if flights.get(&self.key).is_some_and(|f| f.id == self.id) {
            flights.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inner(key: CacheKey, stale_if_error: Duration) -> Inner {
        let policy = CacheSettings {
            key,
            ttl: Duration::from_secs(30),
            stale_if_error,
            ..CacheSettings::default()
        };
        let cache = PartCache::new(
            Service::Promotions,
            &policy,
            Duration::from_secs(1),
            Instruments::register(Service::Promotions),
        );
        Arc::into_inner(cache.inner).expect("the only reference")
    }

    #[test]
    fn cache_control_directives_are_read_case_insensitively_and_malformed_ages_are_stale() {
        let d = Directives::parse("Public, MAX-AGE=60, s-maxage=\"5\"");
        assert_eq!(d.max_age, Some(60));
        assert_eq!(d.s_maxage, Some(5));
        assert!(!d.no_store && !d.private && !d.no_cache);
        let d = Directives::parse("no-store,private=\"set-cookie\", no-cache");
        assert!(d.no_store && d.private && d.no_cache);
        assert_eq!(Directives::parse("max-age=soon").max_age, Some(0));
        assert_eq!(Directives::parse(""), Directives::default());
    }

    #[test]
    fn no_store_is_never_kept_and_private_is_kept_per_user_only() {
        let none = Duration::ZERO;
        let per_user = inner(CacheKey::PerUser, none);
        let shared = inner(CacheKey::Shared, none);
        for cache in [&per_user, &shared] {
            let rule = cache.rule(Directives::parse("no-store"));
            assert!(!rule.store && !rule.shareable);
        }
        let private = Directives::parse("private");
        assert!(per_user.rule(private).store);
        let rule = shared.rule(private);
        assert!(!rule.store && !rule.shareable);
    }

    #[test]
    fn max_age_caps_the_ttl_and_never_extends_it() {
        let cache = inner(CacheKey::Shared, Duration::ZERO);
        let fresh = |v: &str| cache.rule(Directives::parse(v)).fresh_for;
        assert_eq!(fresh("max-age=5"), Duration::from_secs(5));
        assert_eq!(fresh("max-age=3600"), Duration::from_secs(30));
        assert_eq!(fresh(""), Duration::from_secs(30));
        assert_eq!(
            fresh("max-age=60, s-maxage=2"),
            Duration::from_secs(2),
            "a shared cache reads s-maxage first"
        );
        assert!(!cache.rule(Directives::parse("max-age=0")).store);
        assert!(!cache.rule(Directives::parse("no-cache")).store);
        let keeps_stale = inner(CacheKey::Shared, Duration::from_secs(10));
        let rule = keeps_stale.rule(Directives::parse("no-cache"));
        assert!(
            rule.store && rule.fresh_for.is_zero(),
            "kept to stand in for an error"
        );
    }

    #[test]
    fn without_honour_cache_control_every_answer_is_kept_for_the_ttl() {
        let mut cache = inner(CacheKey::Shared, Duration::ZERO);
        cache.honour_cache_control = false;
        let rule = cache.rule(Directives::parse("no-store, private, max-age=1"));
        assert_eq!(
            rule,
            Rule {
                store: true,
                fresh_for: Duration::from_secs(30),
                shareable: true
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_is_fresh_for_its_ttl_then_usable_stale_for_stale_if_error() {
        let entry = Cached {
            body: RawValue::from_string("{}".into()).unwrap(),
            fetched_at: Instant::now(),
            fresh_for: Duration::from_secs(10),
        };
        let stale_if_error = Duration::from_secs(5);
        assert!(entry.is_fresh());
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(!entry.is_fresh() && entry.usable_stale(stale_if_error));
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(!entry.usable_stale(stale_if_error));
    }

    #[tokio::test]
    async fn a_request_without_the_budget_for_a_call_starts_none() {
        // Nothing listens at the service's address: a call, had one started, would fail, and
        // the flight would be in the map until it did.
        let mut settings = crate::config::Settings::default();
        let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        settings.downstreams.promotions.base_url =
            format!("http://{}", nobody.local_addr().unwrap())
                .parse()
                .unwrap();
        drop(nobody);
        let shutdown = tokio_util::sync::CancellationToken::new();
        let queue_delay =
            crate::overload::QueueDelay::spawn(Duration::from_secs(1), shutdown.clone());
        let client = Arc::new(
            Downstream::new(
                Service::Promotions,
                &settings,
                super::super::Client::new(&settings.http_client).unwrap(),
                queue_delay,
            )
            .unwrap(),
        );
        let cache = PartCache::new(
            Service::Promotions,
            &CacheSettings::default(),
            Duration::from_secs(1),
            Instruments::register(Service::Promotions),
        );
        let ctx = Arc::new(RequestContext::new(
            "tiny".into(),
            context::TraceIds {
                trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
                span_id: "b7ad6b7169203331".into(),
                sampled: false,
                tracestate: None,
            },
            Instant::now() + Duration::from_millis(1),
        ));
        let result = context::scope(ctx, cache.fetch(&client, 7)).await;
        assert!(
            matches!(result, Err(CallError::BudgetExhausted { .. })),
            "{result:?}"
        );
        assert!(cache.inner.flights().is_empty(), "no call was started");
        shutdown.cancel();
    }

    #[test]
    fn admin_keys_are_user_ids_or_shared_by_the_cache_kind() {
        let policy = |key| CacheSettings {
            key,
            ..CacheSettings::default()
        };
        let cache = |key| {
            PartCache::new(
                Service::Carts,
                &policy(key),
                Duration::from_secs(1),
                Instruments::register(Service::Carts),
            )
        };
        let per_user = cache(CacheKey::PerUser);
        assert_eq!(per_user.key_from_path("42"), Ok(Key::User(42)));
        assert!(per_user.key_from_path("0").is_err());
        assert!(per_user.key_from_path("shared").is_err());
        let shared = cache(CacheKey::Shared);
        assert_eq!(shared.key_from_path("shared"), Ok(Key::Shared));
        assert!(shared.key_from_path("42").is_err());
    }
}
