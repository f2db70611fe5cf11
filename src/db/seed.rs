//! Demo data for compose, demos and the benchmark lab.
//!
//! Generated inside Postgres with `generate_series` (one statement per batch of users instead
//! of a round trip per row), deterministic for a given user id, and idempotent: users that
//! already have orders are skipped, so running the seed twice changes nothing.

use super::Db;

/// How many users one statement seeds; bounds the size of a single transaction.
const USERS_PER_BATCH: i64 = 5_000;

impl Db {
    /// Gives users `1..=users` `orders_per_user` orders each (skipping users that have any).
    /// Returns the number of orders inserted.
    pub async fn seed(&self, users: i64, orders_per_user: i32) -> anyhow::Result<u64> {
        anyhow::ensure!(users >= 1, "--users must be at least 1");
        anyhow::ensure!(
            (1..=1000).contains(&orders_per_user),
            "--orders-per-user must be between 1 and 1000"
        );
        let mut conn = self.acquire_plain().await?;
        let mut inserted = 0;
        let mut first = 1;
        while first <= users {
            let last = (first + USERS_PER_BATCH - 1).min(users);
            let done = sqlx::query(
                "WITH new_orders AS ( \
                   INSERT INTO orders (user_id, status, total_cents, created_at) \
                   SELECT u, \
                          (ARRAY['created','paid','shipped','delivered','cancelled'])[1 + ((u * 7 + n) % 5)], \
                          100 + ((u * 31 + n * 17) % 50000), \
                          now() - make_interval(days => n, hours => (u % 24)::int) \
                   FROM generate_series($1::int8, $2::int8) AS u \
                   CROSS JOIN generate_series(1, $3::int4) AS n \
                   WHERE NOT EXISTS (SELECT 1 FROM orders o WHERE o.user_id = u) \
                   RETURNING id, total_cents \
                 ) \
                 INSERT INTO order_items (order_id, line_no, sku, quantity, unit_price_cents) \
                 SELECT id, 1, 'SKU-' || lpad((id % 1000)::text, 4, '0'), 1, total_cents FROM new_orders",
            )
            .bind(first)
            .bind(last)
            .bind(orders_per_user)
            .execute(&mut **conn)
            .await?;
            inserted += done.rows_affected();
            first = last + 1;
        }
        sqlx::query("ANALYZE orders").execute(&mut **conn).await?;
        conn.settle();
        Ok(inserted)
    }
}
