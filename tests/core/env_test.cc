#include "zinf/core/env.h"

#include <stdlib.h>

#include <fstream>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace zinf {
namespace {

using ::testing::HasSubstr;

TEST(Env, ReadsKnownVariables) {
  setenv("ZINF_LOG_ALL_RANKS", "1", 1);
  EXPECT_EQ(GetEnv("ZINF_LOG_ALL_RANKS").value_or(""), "1");
  setenv("ZINF_LOG_ALL_RANKS", "", 1);
  EXPECT_FALSE(GetEnv("ZINF_LOG_ALL_RANKS").has_value());
  unsetenv("ZINF_LOG_ALL_RANKS");
}

TEST(EnvDeathTest, AskingForAnUnknownVariableIsAProgrammerError) {
  EXPECT_DEATH((void)GetEnv("ZINF_NOT_A_KNOB"), "not in the table");
}

TEST(Env, ReportsUnknownZinfVariables) {
  setenv("ZINF_LOG_LEVLE", "debug", 1);
  EXPECT_THAT(UnknownZinfEnvVars(), HasSubstr("ZINF_LOG_LEVLE"));
  unsetenv("ZINF_LOG_LEVLE");
  EXPECT_THAT(UnknownZinfEnvVars(), ::testing::Not(HasSubstr("ZINF_LOG_LEVLE")));
}

// README.md's environment table must list every known variable.
TEST(Env, ReadmeListsEveryKnownVariable) {
  std::ifstream readme(ZINF_SOURCE_DIR "/README.md");
  ASSERT_TRUE(readme.good()) << "cannot open README.md";
  std::stringstream text;
  text << readme.rdbuf();
  for (const EnvVarInfo& info : KnownEnvVars()) {
    EXPECT_THAT(text.str(), HasSubstr("`" + std::string(info.name) + "`")) << info.description;
  }
}

}  // namespace
}  // namespace zinf
