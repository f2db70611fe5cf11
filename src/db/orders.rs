//! Orders: the dashboard's recent-orders read and idempotent order creation.
//!
//! Idempotency is enforced by the database, not by a check-then-insert in the application:
//! the key row is inserted in the same transaction as the order. A concurrent duplicate's
//! `INSERT .. ON CONFLICT DO NOTHING` waits on the primary key until the first transaction
//! ends, then finds the committed row and replays its stored response — so concurrent
//! duplicates create exactly one order, and a crash mid-way leaves neither the order nor the key.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize, Serializer};
use sqlx::{Acquire, FromRow, PgConnection, Row, postgres::PgRow};
use tracing::Instrument;

use super::{Db, DbError, Statement};

/// One line of the dashboard's `recent_orders`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OrderSummary {
    #[schema(minimum = 1)]
    pub id: i64,
    #[schema(schema_with = status_schema)]
    pub status: String,
    pub total_cents: i64,
    #[serde(serialize_with = "rfc3339")]
    pub created_at: DateTime<Utc>,
}

/// The same text as chrono's own `Serialize` (RFC 3339, fractional seconds as needed, `Z`),
/// made first and written as one string. chrono's writes through `collect_str`, whose adapter
/// escapes each character on its own: about 2,800 instructions an order, 14,000 a dashboard.
fn rfc3339<S: Serializer>(time: &DateTime<Utc>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&time.to_rfc3339_opts(SecondsFormat::AutoSi, true))
}

impl<'r> FromRow<'r, PgRow> for OrderSummary {
    /// The hot path's query comes over the simple protocol, so every column is text: a
    /// `timestamptz` would be parsed with chrono's format-string parser (about 3,000
    /// instructions a row, 2 % of a dashboard's). The query sends the time as integer
    /// microseconds since the epoch instead, which is exactly what Postgres stores.
    ///
    /// Columns are read by position, in [`PREPARE_RECENT_ORDERS`]'s order: by name, each is a
    /// SipHash lookup in the row's column map, 20 a dashboard (about 2,600 instructions).
    fn from_row(row: &'r PgRow) -> sqlx::Result<Self> {
        let micros: i64 = row.try_get(3)?;
        Ok(Self {
            id: row.try_get(0)?,
            status: row.try_get(1)?,
            total_cents: row.try_get(2)?,
            created_at: DateTime::from_timestamp_micros(micros).ok_or_else(|| {
                sqlx::Error::ColumnDecode {
                    index: "created_at_us".into(),
                    source: format!("{micros} µs is out of chrono's range").into(),
                }
            })?,
        })
    }
}

/// An order's status: the values the `orders` table's CHECK constraint allows.
fn status_schema() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some([
            "created",
            "paid",
            "shipped",
            "delivered",
            "cancelled",
        ]))
        .build()
}

/// A validated order request (see `http::orders` for validation).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct NewOrder {
    pub user_id: i64,
    pub items: Vec<NewItem>,
}

/// One line of an order, as stored and returned (its SKU trimmed).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = OrderItem)]
pub(crate) struct NewItem {
    #[schema(min_length = 1, max_length = 64, example = "SKU-1")]
    pub sku: String,
    #[schema(minimum = 1, maximum = 10_000)]
    pub quantity: i32,
    #[schema(minimum = 0)]
    pub unit_price_cents: i64,
}

/// An order as returned by the API.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub(crate) struct Order {
    #[schema(minimum = 1)]
    pub id: i64,
    #[schema(minimum = 1)]
    pub user_id: i64,
    #[schema(schema_with = status_schema)]
    pub status: String,
    pub total_cents: i64,
    pub created_at: DateTime<Utc>,
    pub items: Vec<NewItem>,
}

/// What happened to a create request.
#[derive(Debug)]
pub(crate) enum CreateOutcome {
    /// A new order was written; `body` is the stored response.
    Created { body: String },
    /// The key was seen before with the same request: the original response, verbatim.
    Replayed { status: u16, body: String },
    /// The key was seen before with a different request.
    Conflict,
}

fn span(statement: Statement) -> tracing::Span {
    let statement = statement.name();
    tracing::info_span!(
        "db.query",
        otel.name = statement,
        otel.kind = "client",
        db.system.name = "postgresql",
        db.operation.name = statement,
    )
}

impl Db {
    /// The user's five most recent orders.
    pub(crate) async fn recent_orders(&self, user_id: i64) -> Result<Vec<OrderSummary>, DbError> {
        async {
            let mut retried = false;
            loop {
                let (mut conn, budget) = self.acquire_for_request().await?;
                let result = {
                    let _t = self.query_timer(Statement::RecentOrders);
                    recent_orders_on(&mut conn, user_id, budget).await
                };
                self.release(conn, result.as_ref().err());
                match result {
                    // A read: always safe to run again.
                    Err(e) if !retried && e.is_connection_lost() => retried = true,
                    r => return r,
                }
            }
        }
        .instrument(span(Statement::RecentOrders))
        .await
    }

    /// Reads one order with its items.
    pub(crate) async fn get_order(&self, id: i64) -> Result<Option<Order>, DbError> {
        async {
            let mut retried = false;
            loop {
                let (mut conn, budget) = self.acquire_for_request().await?;
                let result = {
                    let _t = self.query_timer(Statement::GetOrder);
                    get_order_on(&mut conn, id, budget).await
                };
                self.release(conn, result.as_ref().err());
                match result {
                    Err(e) if !retried && e.is_connection_lost() => retried = true,
                    r => return r,
                }
            }
        }
        .instrument(span(Statement::GetOrder))
        .await
    }

    /// Creates an order under an idempotency key in one transaction.
    /// `request_hash` identifies the request body (same key + same hash = replay).
    ///
    /// A transaction whose connection was lost before `COMMIT` was sent was rolled back by the
    /// server, and is run once more on another connection; one lost at `COMMIT` may or may not
    /// have committed, and is left to the client's retry under the same key.
    pub(crate) async fn create_order(
        &self,
        key: &str,
        request_hash: &[u8],
        order: &NewOrder,
        total_cents: i64,
    ) -> Result<CreateOutcome, DbError> {
        async {
            let mut retried = false;
            loop {
                let (mut conn, budget) = self.acquire_for_request().await?;
                let result = {
                    let _t = self.query_timer(Statement::CreateOrder);
                    create_order_on(&mut conn, budget, key, request_hash, order, total_cents).await
                };
                self.release(
                    conn,
                    match &result {
                        Err(Failed::BeforeCommit(e) | Failed::AtCommit(e)) => Some(e),
                        Ok(_) => None,
                    },
                );
                match result {
                    Err(Failed::BeforeCommit(e)) if !retried && e.is_connection_lost() => {
                        retried = true;
                    }
                    Err(Failed::BeforeCommit(e) | Failed::AtCommit(e)) => return Err(e),
                    Ok(outcome) => return Ok(outcome),
                }
            }
        }
        .instrument(span(Statement::CreateOrder))
        .await
    }
}

/// The hot path's query, prepared at the SQL level once per connection (on its first use, see
/// [`recent_orders_on`]). A simple-protocol query is parsed, analysed and planned by the server
/// every time: 120–129 µs of Postgres CPU per query on the lab's VM, against 38–50 µs for a
/// prepared one (`pgbench -M simple` against `-M prepared`, Postgres alone on one core), so
/// planning was two thirds of what each dashboard cost the database (the lab's
/// `prepared-recent-orders` experiment). Like the protocol-level statements sqlx prepares for
/// the other queries, it lives in the server session: a pooler in front must pool by session.
const PREPARE_RECENT_ORDERS: &str = "PREPARE tributary_recent_orders(int8) AS \
     SELECT id, status, total_cents, \
     (extract(epoch FROM created_at) * 1000000)::int8 AS created_at_us FROM orders \
     WHERE user_id = $1 ORDER BY created_at DESC LIMIT 5";

/// Postgres's `invalid_sql_statement_name`: `EXECUTE` of a statement this session never prepared.
const NOT_PREPARED: &str = "26000";

async fn recent_orders_on(
    conn: &mut PgConnection,
    user_id: i64,
    budget: Duration,
) -> Result<Vec<OrderSummary>, DbError> {
    // The hot path's one round trip: the budget-derived statement_timeout and the query
    // travel in a single simple-protocol message, and the SET applies to the statement after
    // it. The query itself is a prepared statement run with `EXECUTE`, so the server plans it
    // once per connection, not once per dashboard (sqlx's own prepared statements would need a
    // second round trip for the SET). Both values are integers formatted by Rust (user_id is a
    // validated i64), so nothing from the request is ever spliced into SQL text.
    let run = format!(
        "SET statement_timeout = {}; EXECUTE tributary_recent_orders({user_id})",
        super::statement_timeout_ms(budget)
    );
    let rows = match sqlx::raw_sql(sqlx::AssertSqlSafe(run.as_str()))
        .fetch_all(&mut *conn)
        .await
    {
        // A connection that has not prepared it yet (new, or its session was reset): the
        // failed message was one implicit transaction, so its SET was rolled back too. Prepare
        // and run in one message; this connection then has it for the rest of its life.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(NOT_PREPARED) => {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "{PREPARE_RECENT_ORDERS}; {run}"
            )))
            .fetch_all(&mut *conn)
            .await?
        }
        r => r?,
    };
    rows.iter()
        .map(OrderSummary::from_row)
        .collect::<Result<Vec<_>, _>>()
        .map_err(DbError::Database)
}

async fn get_order_on(
    conn: &mut PgConnection,
    id: i64,
    budget: Duration,
) -> Result<Option<Order>, DbError> {
    super::set_statement_timeout(conn, budget).await?;
    let Some(head) = sqlx::query_as::<_, (i64, i64, String, i64, DateTime<Utc>)>(
        "SELECT id, user_id, status, total_cents, created_at FROM orders WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let items = load_items(conn, id).await?;
    Ok(Some(Order {
        id: head.0,
        user_id: head.1,
        status: head.2,
        total_cents: head.3,
        created_at: head.4,
        items,
    }))
}

/// Where the order transaction failed: only before `COMMIT` was sent is it known not to have
/// happened.
enum Failed {
    BeforeCommit(DbError),
    AtCommit(DbError),
}

impl From<DbError> for Failed {
    fn from(e: DbError) -> Self {
        Failed::BeforeCommit(e)
    }
}

impl From<sqlx::Error> for Failed {
    fn from(e: sqlx::Error) -> Self {
        Failed::BeforeCommit(e.into())
    }
}

async fn create_order_on(
    conn: &mut PgConnection,
    budget: Duration,
    key: &str,
    request_hash: &[u8],
    order: &NewOrder,
    total_cents: i64,
) -> Result<CreateOutcome, Failed> {
    super::set_statement_timeout(conn, budget).await?;
    let mut tx = conn.begin().await?;
    let claimed: Option<i32> = sqlx::query_scalar(
        "INSERT INTO idempotency_keys (key, request_hash) VALUES ($1, $2) \
         ON CONFLICT (key) DO NOTHING RETURNING 1",
    )
    .bind(key)
    .bind(request_hash)
    .fetch_optional(&mut *tx)
    .await?;
    if claimed.is_none() {
        // Someone committed this key first (we waited for them if they were mid-way).
        let (hash, status, body): (Vec<u8>, Option<i16>, Option<String>) = sqlx::query_as(
            "SELECT request_hash, response_status, response_body \
             FROM idempotency_keys WHERE key = $1",
        )
        .bind(key)
        .fetch_one(&mut *tx)
        .await?;
        tx.rollback().await?;
        return match (hash == request_hash, status, body) {
            (true, Some(status), Some(body)) => Ok(CreateOutcome::Replayed {
                status: status as u16,
                body,
            }),
            (true, _, _) => Err(Failed::BeforeCommit(DbError::Database(
                sqlx::Error::Protocol("idempotency key committed without a response".into()),
            ))),
            (false, _, _) => Ok(CreateOutcome::Conflict),
        };
    }
    let (id, status, created_at): (i64, String, DateTime<Utc>) = sqlx::query_as(
        "INSERT INTO orders (user_id, total_cents) VALUES ($1, $2) \
         RETURNING id, status, created_at",
    )
    .bind(order.user_id)
    .bind(total_cents)
    .fetch_one(&mut *tx)
    .await?;
    let skus: Vec<&str> = order.items.iter().map(|i| i.sku.as_str()).collect();
    let quantities: Vec<i32> = order.items.iter().map(|i| i.quantity).collect();
    let prices: Vec<i64> = order.items.iter().map(|i| i.unit_price_cents).collect();
    sqlx::query(
        "INSERT INTO order_items (order_id, line_no, sku, quantity, unit_price_cents) \
         SELECT $1, t.ord, t.sku, t.quantity, t.price \
         FROM unnest($2::text[], $3::int4[], $4::int8[]) WITH ORDINALITY \
              AS t(sku, quantity, price, ord)",
    )
    .bind(id)
    .bind(&skus)
    .bind(&quantities)
    .bind(&prices)
    .execute(&mut *tx)
    .await?;
    let body = serde_json::to_string(&Order {
        id,
        user_id: order.user_id,
        status,
        total_cents,
        created_at,
        items: order.items.clone(),
    })
    .map_err(|e| DbError::Database(sqlx::Error::Encode(Box::new(e))))?;
    sqlx::query(
        "UPDATE idempotency_keys SET order_id = $2, response_status = 201, response_body = $3 \
         WHERE key = $1",
    )
    .bind(key)
    .bind(id)
    .bind(&body)
    .execute(&mut *tx)
    .await?;
    tx.commit().await.map_err(|e| Failed::AtCommit(e.into()))?;
    Ok(CreateOutcome::Created { body })
}

async fn load_items(conn: &mut PgConnection, order_id: i64) -> Result<Vec<NewItem>, sqlx::Error> {
    let rows: Vec<(String, i32, i64)> = sqlx::query_as(
        "SELECT sku, quantity, unit_price_cents FROM order_items WHERE order_id = $1 ORDER BY line_no",
    )
    .bind(order_id)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(sku, quantity, unit_price_cents)| NewItem {
            sku,
            quantity,
            unit_price_cents,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::{Connection, Executor};

    /// How many times this session has run the prepared recent-orders statement (`None`: it
    /// has not prepared it).
    async fn executions(conn: &mut PgConnection) -> Option<i64> {
        sqlx::query_scalar(
            "SELECT generic_plans + custom_plans FROM pg_prepared_statements \
             WHERE name = 'tributary_recent_orders'",
        )
        // Unnamed: DEALLOCATE ALL below would take a cached statement of sqlx's with it.
        .persistent(false)
        .fetch_optional(conn)
        .await
        .unwrap()
    }

    /// Against the real Postgres the integration tests use (`DATABASE_URL`), on a session-private
    /// temporary `orders` table (it shadows any real one and is gone with the session).
    #[tokio::test]
    async fn recent_orders_are_prepared_once_per_session_and_prepared_again_after_a_reset() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let mut conn = PgConnection::connect(&url)
            .await
            .expect("Postgres must be reachable at DATABASE_URL (see README: Tests)");
        conn.execute(
            "CREATE TEMP TABLE orders (id int8, user_id int8, status text, total_cents int8, \
             created_at timestamptz); \
             INSERT INTO orders SELECT n, 7, 'paid', n * 100, \
             timestamptz '2026-12-01 00:00:00Z' + n * interval '1 hour' \
             FROM generate_series(1, 6) AS n",
        )
        .await
        .unwrap();

        for run in 1..=3 {
            let orders = recent_orders_on(&mut conn, 7, Duration::from_millis(1234))
                .await
                .unwrap();
            let ids: Vec<i64> = orders.iter().map(|o| o.id).collect();
            assert_eq!(
                ids,
                [6, 5, 4, 3, 2],
                "run {run}: the five newest, newest first"
            );
        }
        // One statement, prepared on the first run and executed by all three.
        assert_eq!(executions(&mut conn).await, Some(3));
        // The request's budget still bounds the statement: the SET travels with each EXECUTE.
        let timeout: String = sqlx::query_scalar("SHOW statement_timeout")
            .persistent(false)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(timeout, "1234ms");

        // A session that lost its prepared statements (DISCARD ALL, as a pooler does between
        // clients) prepares it again instead of failing the dashboard's part.
        conn.execute("DEALLOCATE ALL").await.unwrap();
        let orders = recent_orders_on(&mut conn, 7, Duration::from_millis(800))
            .await
            .unwrap();
        assert_eq!(orders.len(), 5);
        assert_eq!(executions(&mut conn).await, Some(1));
        conn.close().await.unwrap();
    }

    /// The dashboard's orders part is moved whole into each future that awaits it on its
    /// first poll; with sqlx's acquire (2.5 KB) inline it was 2,976 bytes, copied three times a
    /// dashboard (deadpool's checkout, 680 bytes, is boxed as well). Sizes are the compiler's,
    /// not timings.
    #[tokio::test]
    async fn the_orders_future_does_not_carry_the_pools_acquire_inline() {
        let db = Db::connect_lazy(&crate::config::Settings::default().database).unwrap();
        let size = std::mem::size_of_val(&db.recent_orders(1));
        assert!(size < 1024, "the recent-orders future is {size} bytes");
    }

    #[test]
    fn created_at_is_written_as_chronos_own_serialize_writes_it() {
        for micros in [
            0,
            1_764_763_200_000_000, // whole seconds: no fraction
            1_764_763_200_120_000, // milliseconds
            1_764_763_200_123_456, // microseconds
            -86_400_000_001,       // before the epoch
        ] {
            let time = DateTime::from_timestamp_micros(micros).unwrap();
            let order = OrderSummary {
                id: 1,
                status: "paid".into(),
                total_cents: 100,
                created_at: time,
            };
            let ours = serde_json::to_value(&order).unwrap();
            assert_eq!(
                ours["created_at"],
                serde_json::to_value(time).unwrap(),
                "at {micros} µs"
            );
        }
    }
}
