//! The process-wide TLS set-up.
//!
//! Every rustls client in the process (the downstream client and the OTLP exporter's) uses the
//! process-level crypto provider, and reqwest is built without one of its own; whichever client
//! is built first installs it. A leaf, so that neither client has to import the other's module.

/// Installs the ring provider as the process's default; a second install is harmless (tests
/// build many clients), so its error is ignored.
pub(crate) fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
