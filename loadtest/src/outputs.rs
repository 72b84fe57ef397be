//! Where a command writes: checked before any work is done (a long run's results must not be lost
//! at its end), never one of the command's own inputs, and named in every error.

use std::path::Path;

use anyhow::{Context, bail};

/// Whether `a` and `b` are the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// Refuses `output` when it is one of `inputs`.
pub fn not_an_input(output: &Path, inputs: &[&Path]) -> anyhow::Result<()> {
    if inputs.iter().any(|i| same_file(output, i)) {
        bail!(
            "{} is also an input of this command: it would be overwritten (choose another output path)",
            output.display()
        );
    }
    Ok(())
}

/// Readies the output directory `dir` for `files`: creates it, and checks that it takes files
/// and that none of `files` is a directory or one of `inputs`.
pub fn out_dir(dir: &Path, files: &[&str], inputs: &[&Path]) -> anyhow::Result<()> {
    if dir.exists() && !dir.is_dir() {
        bail!("the output directory {} is a file", dir.display());
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the output directory {}", dir.display()))?;
    for f in files {
        let path = dir.join(f);
        if path.is_dir() {
            bail!("cannot write {}: it is a directory", path.display());
        }
        not_an_input(&path, inputs)?;
    }
    let probe = dir.join(format!(".headroom-write-check.{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("cannot write in the output directory {}", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Writes `data` to `path`, naming the path in an error.
pub fn write(path: &Path, data: impl AsRef<[u8]>) -> anyhow::Result<()> {
    std::fs::write(path, data).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_that_is_an_input_or_a_file_or_a_directory_is_refused_before_any_work() {
        let dir = std::env::temp_dir().join(format!("headroom-outputs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("out/report.html")).unwrap();
        let input = dir.join("out/result.json");
        std::fs::write(&input, "{}").unwrap();
        // The same file by another spelling.
        let again = dir.join("out/../out/result.json");
        assert!(not_an_input(&again, &[&input]).is_err());
        assert!(not_an_input(&dir.join("other.json"), &[&input]).is_ok());
        let e = out_dir(&dir.join("out"), &["result.json"], &[&input]).unwrap_err();
        assert!(e.to_string().contains("also an input"), "{e}");
        let e = out_dir(&dir.join("out"), &["report.html"], &[]).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        let e = out_dir(&input, &["x"], &[]).unwrap_err();
        assert!(e.to_string().contains("is a file"), "{e}");
        out_dir(&dir.join("fresh/deeper"), &["result.json"], &[&input]).unwrap();
        assert!(dir.join("fresh/deeper").is_dir());
        assert_eq!(
            std::fs::read_dir(dir.join("fresh/deeper")).unwrap().count(),
            0
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
