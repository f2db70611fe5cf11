//! Loading: the file, the environment and the two conventional variables, layered through
//! figment into one [`Settings`].

use std::path::{Path, PathBuf};

use figment::{
    Figment,
    error::{Actual, Kind},
    providers::{Format, Serialized, Toml},
    value::{Dict, Value},
};

use super::{AdmissionGroupSettings, RouteGroup, Settings};

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
        let (settings, invalid) = extract(&figment);
        problems.extend(invalid);
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

/// One problem as `path: what is wrong`. A string that was the wrong type is shown with any
/// URL password in it masked: the message goes to a terminal or a log.
fn describe(e: &figment::Error) -> String {
    let kind = match &e.kind {
        Kind::InvalidType(Actual::Str(v), expected) => {
            Kind::InvalidType(Actual::Str(mask_password(v)), expected.clone()).to_string()
        }
        Kind::InvalidValue(Actual::Str(v), expected) => {
            Kind::InvalidValue(Actual::Str(mask_password(v)), expected.clone()).to_string()
        }
        other => other.to_string(),
    };
    let path = e.path.join(".");
    if path.is_empty() {
        kind
    } else {
        format!("{path}: {kind}")
    }
}

/// `value` with the password of a URL replaced by `***` (unchanged when it holds none).
fn mask_password(value: &str) -> String {
    match url::Url::parse(value) {
        Ok(mut url) if url.password().is_some() => {
            let _ = url.set_password(Some("***"));
            url.to_string()
        }
        _ => value.to_owned(),
    }
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
}
