//! Loading: the file, the environment and the two conventional variables, layered through
//! figment into one [`Settings`].

use std::path::{Path, PathBuf};

use figment::{
    Figment,
    error::Kind,
    providers::{Format, Serialized, Toml},
    value::{Dict, Value},
};

use super::{AdmissionGroupSettings, CacheSettings, RouteGroup, Settings};

/// Environment variables with the `TRIBUTARY_` prefix that are not settings: the file to
/// load, and a build input read at compile time.
const NOT_SETTINGS: [&str; 2] = ["TRIBUTARY_CONFIG", "TRIBUTARY_GIT_REVISION"];

/// The file loaded when none is named, if it exists (relative to the working directory).
const DEFAULT_FILE: &str = "config/default.toml";

/// A configuration problem, worded for the person who has to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration could not be read: {0}")]
    Load(String),
    #[error("invalid configuration: {}", .0.join("; "))]
    Invalid(Vec<String>),
}

/// Where settings come from; a value so that tests can build one without touching the process
/// environment.
#[derive(Debug, Default, Clone)]
pub struct Sources {
    /// The TOML file to load; it must exist.
    pub file: Option<PathBuf>,
    /// Environment variables as `(name, value)` pairs.
    pub env: Vec<(String, String)>,
}

impl Sources {
    /// The process environment, and the file named by `--config` (`cli_file`), else by
    /// `TRIBUTARY_CONFIG`, else `config/default.toml` when it exists.
    pub fn from_process(cli_file: Option<&Path>) -> Self {
        let env: Vec<(String, String)> = std::env::vars().collect();
        let named = env
            .iter()
            .find(|(k, v)| k == "TRIBUTARY_CONFIG" && !v.is_empty())
            .map(|(_, v)| PathBuf::from(v));
        let file = cli_file.map(Path::to_path_buf).or(named).or_else(|| {
            let default = PathBuf::from(DEFAULT_FILE);
            default.exists().then_some(default)
        });
        Self { file, env }
    }

    fn var(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Settings {
    /// Loads settings from the given sources, parsing every value into its type, and checks the
    /// rules that relate two keys.
    pub fn load(sources: &Sources) -> Result<Self, ConfigError> {
        let mut figment = Figment::new();
        match &sources.file {
            Some(path) if !path.exists() => {
                return Err(ConfigError::Load(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            Some(path) => figment = figment.merge(Toml::file_exact(path)),
            None => {}
        }
        // Environment overrides go through figment as `(dotted.path, value)` pairs built from
        // the given variables, so tests never have to mutate the process environment.
        let (overrides, mut problems) = env_overrides(&sources.env);
        for (path, value) in overrides {
            let parsed: figment::value::Value = value
                .parse()
                .unwrap_or_else(|_| figment::value::Value::from(value.to_owned()));
            figment = figment.merge((path, parsed));
        }
        if let Some(url) = sources.var("DATABASE_URL") {
            figment = figment.merge(("database.url", url));
        }
        if let Some(directives) = sources.var("RUST_LOG").filter(|v| !v.trim().is_empty()) {
            figment = figment.merge(("telemetry.log_level", directives));
        }
        let (mut settings, invalid) = extract(&figment);
        problems.extend(invalid);
        // The OpenTelemetry environment, resolved under the `telemetry.*` keys.
        if let Some(Err(otel)) = settings
            .as_mut()
            .map(|s| s.telemetry.read_otel_env(&sources.env))
        {
            problems.extend(otel);
        }
        // The rules that relate two keys are checked even when some value did not parse (on
        // what did, with defaults for the rest), so that one run reports every problem.
        if let Some(Err(ConfigError::Invalid(crossed))) = settings.as_ref().map(Settings::validate)
        {
            problems.extend(crossed);
        }
        match settings {
            Some(settings) if problems.is_empty() => Ok(settings),
            _ => Err(ConfigError::Invalid(problems)),
        }
    }
}

/// The `TRIBUTARY_<SECTION>__<KEY>` variables as `(section.key, value)` overrides, and a
/// problem for each such variable that names no key.
fn env_overrides(env: &[(String, String)]) -> (Vec<(String, &str)>, Vec<String>) {
    let known = known_keys();
    let mut overrides = Vec::new();
    let mut unknown = Vec::new();
    for (name, value) in env {
        let Some(rest) = name.strip_prefix("TRIBUTARY_") else {
            continue;
        };
        if NOT_SETTINGS.contains(&name.as_str()) {
            continue;
        }
        let path = rest.to_ascii_lowercase().replace("__", ".");
        if known.contains(&path) {
            overrides.push((path, value.as_str()));
        } else {
            unknown.push(unknown_variable(name, &known));
        }
    }
    (overrides, unknown)
}

/// Every key a setting can be given under, as a dotted path (`database.max_connections`).
fn known_keys() -> Vec<String> {
    // The defaults with every map filled in, so that map entries have their keys too.
    let mut template = Settings::default();
    for group in RouteGroup::ALL {
        template.admission.groups.insert(
            group,
            AdmissionGroupSettings {
                max_in_flight: Some(template.admission.max_in_flight),
                max_wait: Some(template.admission.max_wait),
            },
        );
    }
    // A cache section is unset by default; its keys exist all the same.
    for downstream in template.downstreams.iter_mut() {
        downstream.cache = Some(CacheSettings::default());
    }
    let tree = serde_json::to_value(&template).expect("settings serialise to JSON");
    let mut keys = Vec::new();
    leaf_paths(&tree, &mut String::new(), &mut keys);
    keys
}

fn leaf_paths(value: &serde_json::Value, prefix: &mut String, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, child) in map {
                let len = prefix.len();
                if !prefix.is_empty() {
                    prefix.push('.');
                }
                prefix.push_str(key);
                leaf_paths(child, prefix, out);
                prefix.truncate(len);
            }
        }
        _ => out.push(prefix.clone()),
    }
}

/// The message for a `TRIBUTARY_*` variable that names no key, with the closest one.
fn unknown_variable(name: &str, known: &[String]) -> String {
    let as_variable =
        |key: &str| format!("TRIBUTARY_{}", key.to_ascii_uppercase().replace('.', "__"));
    let closest = known
        .iter()
        .map(|k| as_variable(k))
        .min_by_key(|candidate| strsim::levenshtein(name, candidate));
    match closest {
        Some(closest) => format!(
            "environment variable {name} names no setting; did you mean {closest}? \
             (levels are separated by a double underscore)"
        ),
        None => format!("environment variable {name} names no setting"),
    }
}

/// Extracts the settings, reporting every value that does not parse rather than only the
/// first: serde stops at the first error, so each offending key is set aside (removed, so that
/// its default applies) and the extraction repeated, until it succeeds or nothing is left to
/// set aside. Each round removes a key, so the loop ends. Returns the settings with the
/// offending keys at their defaults, when that much could be read, and the problems.
fn extract(figment: &Figment) -> (Option<Settings>, Vec<String>) {
    let mut error = match figment.extract::<Settings>() {
        Ok(settings) => return (Some(settings), Vec::new()),
        Err(e) => e,
    };
    let mut problems = Vec::new();
    let Ok(mut data) = figment.extract::<Dict>() else {
        return (None, error.into_iter().map(|e| describe(&e)).collect());
    };
    loop {
        let mut set_aside = false;
        for e in error {
            problems.push(describe(&e));
            let mut path = e.path.clone();
            if let Kind::UnknownField(field, _) = &e.kind {
                path.push(field.clone());
            }
            set_aside |= remove(&mut data, &path);
        }
        if !set_aside {
            return (None, problems);
        }
        match Figment::from(Serialized::defaults(&data)).extract::<Settings>() {
            Ok(rest) => return (Some(rest), problems),
            Err(e) => error = e,
        }
    }
}

/// Removes the value at `path`, or the list that holds it; false when there is none.
fn remove(dict: &mut Dict, path: &[String]) -> bool {
    let Some((key, rest)) = path.split_first() else {
        return false;
    };
    match dict.get_mut(key) {
        Some(Value::Dict(_, inner)) if !rest.is_empty() => remove(inner, rest),
        Some(_) => dict.remove(key).is_some(),
        None => false,
    }
}

/// One problem as `path: what is wrong`, with the credentials of any URL in it masked: the
/// message goes to a terminal or a log, and the value a setting rejects can be anything —
/// a URL put where a number, an address or a header name belongs, one that does not parse.
fn describe(e: &figment::Error) -> String {
    let path = e.path.join(".");
    let message = if path.is_empty() {
        e.kind.to_string()
    } else {
        format!("{path}: {}", e.kind)
    };
    mask_userinfo(&message)
}

/// `text` with the userinfo of every `scheme://userinfo@host` in it masked: a password
/// becomes `***` (`postgres://app:***@db/app`), and so does a userinfo without one, which
/// is often a token (`https://***@host`). It works on the text, so it also masks a URL that
/// does not parse (a bad port, say).
pub(crate) fn mask_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        // The authority ends where the path, query or fragment begins, or the URL does.
        let end = tail
            .find(|c: char| {
                matches!(c, '/' | '?' | '#' | '"' | '\'' | '`' | ')' | ']' | ';')
                    || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                match authority[..at].split_once(':') {
                    Some((user, _)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str("***"),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_put_where_a_number_belongs_is_shown_without_its_password() {
        let err = Settings::load(&Sources {
            file: None,
            env: vec![(
                "TRIBUTARY_DATABASE__MAX_CONNECTIONS".into(),
                "postgres://app:hunter2@db/app".into(),
            )],
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("database.max_connections: invalid type"),
            "{err}"
        );
        assert!(err.contains("postgres://app:***@db/app"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn no_rejected_value_shows_a_url_password_whatever_the_setting() {
        for (key, value) in [
            // Does not parse as a URL (the port), so a URL parser cannot mask it.
            (
                "TRIBUTARY_DATABASE__MAX_CONNECTIONS",
                "postgres://app:hunter2@db:99999/app",
            ),
            // Rejected by the setting's own type, whose message quotes the value.
            (
                "TRIBUTARY_RATE_LIMIT__TRUSTED_PROXIES",
                "[\"redis://:hunter2@cache:6379\"]",
            ),
            (
                "TRIBUTARY_TELEMETRY__LOG_FORMAT",
                "https://user:hunter2@host/",
            ),
            (
                "TRIBUTARY_DOWNSTREAMS__CARTS__BASE_URL",
                "ftp://user:hunter2@carts",
            ),
            ("DATABASE_URL", "mysql://app:hunter2@db/app"),
            ("TRIBUTARY_SERVER__LISTEN", "http://hunter2@0.0.0.0:8080"),
        ] {
            let err = Settings::load(&Sources {
                file: None,
                env: vec![(key.into(), value.into())],
            })
            .expect_err(key)
            .to_string();
            assert!(!err.contains("hunter2"), "{key}: {err}");
        }
    }

    #[test]
    fn userinfo_is_masked_in_any_text() {
        assert_eq!(
            mask_userinfo("bad `postgres://app:pw@db:99999/x` and https://tok@h/p?q=1"),
            "bad `postgres://app:***@db:99999/x` and https://***@h/p?q=1"
        );
        assert_eq!(mask_userinfo("no url here"), "no url here");
        assert_eq!(mask_userinfo("http://host:80/a@b"), "http://host:80/a@b");
    }
}
