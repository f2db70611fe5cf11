-- Orders and their items. `orders_user_recent_idx` serves the dashboard's "five most recent
-- orders of a user" query as an index-only range scan in the order it is read.
CREATE TABLE orders (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id     BIGINT      NOT NULL CHECK (user_id > 0),
    status      TEXT        NOT NULL DEFAULT 'created'
                CHECK (status IN ('created', 'paid', 'shipped', 'delivered', 'cancelled')),
    total_cents BIGINT      NOT NULL CHECK (total_cents >= 0),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE INDEX orders_user_recent_idx ON orders (user_id, created_at DESC) INCLUDE (status, total_cents);

CREATE TABLE order_items (
    order_id         BIGINT  NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    line_no          INTEGER NOT NULL CHECK (line_no > 0),
    sku              TEXT    NOT NULL CHECK (length(sku) BETWEEN 1 AND 64),
    quantity         INTEGER NOT NULL CHECK (quantity > 0),
    unit_price_cents BIGINT  NOT NULL CHECK (unit_price_cents >= 0),
    PRIMARY KEY (order_id, line_no)
);

-- One row per Idempotency-Key. The row is inserted in the same transaction as the order, so a
-- key either has its order and stored response or does not exist at all; a concurrent duplicate
-- blocks on the primary key until the first transaction ends and then reads its response.
CREATE TABLE idempotency_keys (
    key             TEXT        PRIMARY KEY CHECK (length(key) BETWEEN 1 AND 255),
    request_hash    BYTEA       NOT NULL,
    order_id        BIGINT      REFERENCES orders (id) ON DELETE CASCADE,
    response_status SMALLINT,
    response_body   TEXT,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);
